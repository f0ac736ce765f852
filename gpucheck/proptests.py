"""The **tests** step (issue 38 item 3): the hypothesis property suite's device parametrization in a pytest child
(:func:`step_tests`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dtbench.gpucheck.common import tests_dir

# the property tests parametrized over the device (models.DEVICES): the conformance kit on every built-in first (issue
# 56: `dtbench check --all --device cuda` as pytest ids), then equivalence, batched (B > 1), heads, training-free,
# compiled execution, resident tree drafting
TEST_MODULES = (
    "tests/test_conformance.py",
    "tests/test_conformance_compiled.py",  # full tier: deselected by the step's default tier, run with --tier full
    "tests/test_conformance_sampling.py",
    "tests/test_equivalence.py",
    "tests/test_batching.py",
    "tests/test_heads.py",
    "tests/test_training_free.py",
    "tests/test_tree_resident.py",
)
TEST_EXAMPLES = 5  # hypothesis examples per property test (models.EXAMPLES_ENV): within the check's 8 minutes
TEST_TIMEOUT_S = 300


def parse_hypothesis_statistics(text: str) -> dict[str, dict[str, int]]:
    """{test id: {"passing", "failing", "invalid"}} summed over phases, from pytest's ``--hypothesis-show-statistics``
    output (hypothesis's "Hypothesis Statistics" section: a ``path::test[param]:`` line, then per phase
    "- N passing, N failing, and N invalid test cases")."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^(\S+::\S+):\s*$", line)
        if head:
            current = out.setdefault(head.group(1), {"passing": 0, "failing": 0, "invalid": 0})
            continue
        # hypothesis 6.1xx: "N passing, N failing, and N invalid test cases" (older: "N passing examples, ...")
        counts = re.search(r"(\d+) passing\b.*?(\d+) failing\b.*?(\d+) invalid", line)
        if counts and current is not None:
            for key, value in zip(("passing", "failing", "invalid"), counts.groups(), strict=True):
                current[key] += int(value)
    return out


def parse_verbose(text: str) -> dict:
    """passed/failed/skipped counts and the failed test ids from ``pytest -v`` lines (``path::test[id] PASSED``): what a
    child stopped at its time limit leaves (it writes no JUnit XML)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for test, outcome in re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M):
        key = {"PASSED": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
        counts[key] += 1
        if key == "failed":
            failures.append({"test": test, "falsifying_example": None, "message": outcome})
    return {**counts, "failures": failures}


def parse_junit(path: Path) -> dict:
    """passed/failed/skipped counts and each failure (test id, message with hypothesis's falsifying example) from a
    pytest ``--junitxml`` file."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            text = f"{bad.get('message', '')}\n{bad.text or ''}"
            found = re.search(r"Falsifying example:.*?(?=\n\S|\Z)", text, re.S)
            failures.append(
                {"test": name, "falsifying_example": found.group(0) if found else None, "message": text[-1500:]}
            )
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def step_tests(device, out_dir: Path, log) -> dict:
    """Run the property tests' ``device`` parametrization (``-k cuda`` on a GPU, ``-k cpu`` on a CPU) in a pytest
    child (``-P``: the checkout's dtbench/ does not shadow the installed one) with :data:`TEST_EXAMPLES` examples per
    test and a :data:`TEST_TIMEOUT_S` limit; counts from its JUnit XML, example counts from
    ``--hypothesis-show-statistics``. Passes when something ran and nothing failed."""
    import os
    import subprocess

    root = tests_dir().parent
    junit = out_dir / "tests.junit.xml"
    junit.unlink(missing_ok=True)
    selector = "cuda" if device.type == "cuda" else "cpu"
    cmd = [sys.executable, "-P", "-m", "pytest", "-v", "-p", "no:cacheprovider", *TEST_MODULES, "-k", selector]
    cmd += [f"--junitxml={junit}", "--hypothesis-show-statistics"]
    env = {**os.environ, "DTBENCH_HYPOTHESIS_EXAMPLES": str(TEST_EXAMPLES)}
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # what finished before the limit is kept (-v: a line per test)
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        (out_dir / "tests.log").write_text(text, encoding="utf-8")
        partial = parse_verbose(text)
        log(f"tests: ran past {TEST_TIMEOUT_S} s; {partial['passed']} passed, {partial['failed']} failed before it")
        return {"ok": False, "error": f"pytest ran past {TEST_TIMEOUT_S} s", "modules": list(TEST_MODULES), **partial}
    (out_dir / "tests.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if not junit.exists():
        return {
            "ok": False,
            "error": f"pytest exited {done.returncode}: {done.stdout[-500:]}",
            "modules": list(TEST_MODULES),
        }
    res = parse_junit(junit)
    stats = parse_hypothesis_statistics(done.stdout)
    log(f"tests: {res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped ({selector})")
    return {
        "ok": res["failed"] == 0 and res["passed"] > 0,
        "modules": list(TEST_MODULES),
        "selection": selector,
        "examples_per_test": TEST_EXAMPLES,
        **res,
        "hypothesis": stats,
        "examples_total": sum(v["passing"] + v["failing"] for v in stats.values()),
    }


# --- smoke: suites/gpu-smoke.yaml through `dtbench run` (issue 38 item 4) ------------------------------------------
