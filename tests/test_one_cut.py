"""Issue 68 item 5: one cut of a row's output (its first T tokens, nothing after the first EOS), shared by the runner
(harness/measurement/measure.py) and the conformance kit (dtbench/testing/common.py): written once, in decoders/cut.py."""

from __future__ import annotations

import ast
from pathlib import Path

from dtbench.decoders.base import Step, cut_at_eos
from dtbench.decoders.cut import cut_tokens

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)
ROOT = Path(__file__).resolve().parents[1]


def test_the_cut_keeps_T_tokens_and_nothing_after_the_first_eos():
    eos = frozenset({2})
    assert cut_tokens([5, 6, 7, 8], 3, eos) == [5, 6, 7]
    assert cut_tokens([5, 2, 7, 2], 4, eos) == [5, 2]
    assert cut_tokens([5, 6, 7, 2], 3, eos) == [5, 6, 7]  # an EOS past T is not reached
    assert cut_tokens([5, 2], 9, frozenset()) == [5, 2]
    step, ended = cut_at_eos(Step((5, 2, 7), drafted=3, accepted=3, depth=3), eos)
    assert ended and step.tokens == (5, 2) and step.accepted == 2


def test_no_other_module_writes_its_own_cut():
    """The runner and the kit call decoders/cut.cut_tokens; a function named like a cut anywhere else is a copy."""
    names = {"cut", "cut_tokens", "cut_output", "_cut"}
    found = []
    for folder in ("harness", "decoders", "reports", "dtbench", "cli", "gpucheck"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert found == ["decoders/cut.py:cut_tokens"], found
    for user in ("harness/measurement/measure.py", "dtbench/testing/common.py", "dtbench/testing/checks.py"):
        assert "cut_tokens(" in (ROOT / user).read_text(), user
