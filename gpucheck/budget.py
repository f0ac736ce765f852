"""The GPU check's time budget (issue 46 item 7): a GPU is lent for 15 minutes of device time, the machine's start
(1-2 min) included, with room to rerun one step, so the check plans its steps against a budget (9 minutes for the
whole check, install and compiles included) instead of running past the lease.

With ``--budget SECONDS`` the steps run in order of value (:data:`VALUE_ORDER`: the property tests on the device,
compiled execution, the end-to-end smoke run and the lossless rows first) and a step whose planned seconds do not fit
what is left is skipped, with why, in ``gpu-check.json``'s ``skipped_steps``; before each step the plan is checked
again against the seconds actually left. Planned seconds are data (:data:`PLANNED_S`), from the last measured runs.
"""

from __future__ import annotations

from collections.abc import Iterable

# Most valuable first: what only a GPU can show and what failed or was never shown there before.
VALUE_ORDER = ("tests", "compiled", "smoke", "lossless", "costmodel", "overhead", "timing")
LEASE_BUDGET_S = 540.0  # 9 minutes: 15 of device time less the start (1-2 min) and a rerun of one step

# Planned seconds per step. cuda: an NVIDIA H200 (torch 2.11.0+cu130): lossless, timing, costmodel and overhead from
# docs/gpu-check-h200.json; compiled, tests and smoke from issue 46's run (main 5f914b9). cpu: `make gpu-check-dry`
# (--small) on the 2-core VM, 2026-11-27, its second run (inductor's cache warm), beside a test run.
PLANNED_S: dict[str, dict[str, float]] = {
    "cuda": {
        "tests": 244.0,
        "compiled": 441.0,  # 381 s measured; + 60 s estimated (not measured) for the fused_draft row's two region graphs
        "smoke": 111.0,
        "lossless": 88.0,
        "costmodel": 49.0,
        "overhead": 100.0,  # 78 s measured with 10 decoders; 3 resident tree rows added since (issue 46)
        "timing": 18.0,
    },
    "cpu": {
        "tests": 45.0,
        "compiled": 39.0,
        "smoke": 86.0,
        "lossless": 33.0,
        "costmodel": 18.0,
        "overhead": 40.0,  # 31 s measured with 10 decoders; 3 resident tree rows added since (issue 46)
        "timing": 11.0,
    },
}


def plan_steps(
    chosen: Iterable[str], device_type: str, budget_s: float | None, spent_s: float = 0.0
) -> tuple[list[str], dict[str, str]]:
    """(the steps to run, in order; skipped step -> why) for ``chosen`` steps on ``device_type``.

    Without a budget: every chosen step, in the order given, none skipped. With one: the chosen steps in
    :data:`VALUE_ORDER`, each kept while its planned seconds fit what is left of ``budget_s`` after ``spent_s``
    (seconds already used, e.g. the install).
    """
    steps = list(chosen)
    if budget_s is None:
        return steps, {}
    planned = PLANNED_S.get(device_type, PLANNED_S["cuda"])
    left = budget_s - spent_s
    run, skipped = [], {}
    for step in sorted(steps, key=VALUE_ORDER.index):
        need = planned.get(step, 0.0)
        if need <= left:
            run.append(step)
            left -= need
        else:
            skipped[step] = f"planned {need:.0f} s, {max(left, 0.0):.0f} s of the {budget_s:.0f} s budget left"
    return run, skipped


def still_fits(step: str, device_type: str, budget_s: float | None, elapsed_s: float) -> str | None:
    """None when ``step`` still fits the budget after ``elapsed_s`` seconds; else why it is skipped."""
    if budget_s is None:
        return None
    need = PLANNED_S.get(device_type, PLANNED_S["cuda"]).get(step, 0.0)
    left = budget_s - elapsed_s
    return None if need <= left else f"planned {need:.0f} s, {max(left, 0.0):.0f} s left when its turn came"


def plan_lines(
    device_type: str, budget_s: float = LEASE_BUDGET_S, spent_s: float = 0.0, steps: list[str] | None = None
) -> list[str]:
    """The plan of the check on ``device_type`` against ``budget_s``: one line per step asked for (``steps``; None:
    every step), its planned minutes, run or skipped, and a total."""
    planned = PLANNED_S.get(device_type, PLANNED_S["cuda"])
    asked = [s for s in VALUE_ORDER if steps is None or s in steps]
    run, skipped = plan_steps(asked, device_type, budget_s, spent_s)
    lines = [f"plan on {device_type} against a {budget_s / 60:.1f}-minute budget ({spent_s:.0f} s already spent):"]
    for step in asked:
        verdict = "run" if step in run else f"skip ({skipped[step]})"
        lines.append(f"  {step:10} {planned[step] / 60:5.1f} min  {verdict}")
    total = sum(planned[s] for s in run)
    lines.append(
        f"  total      {total / 60:5.1f} min planned of {budget_s / 60:.1f}; all steps would take "
        f"{sum(planned.values()) / 60:.1f} min"
    )
    return lines
