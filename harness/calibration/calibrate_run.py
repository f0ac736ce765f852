"""The run's side of calibration (split from :mod:`dtbench.harness.calibration.calibrate`, which measures the curves): storing a
calibration batch (:func:`store`), ``n_max: auto`` (the budgets resolved from the target's tree-verify curve and
handed to every worker), and the runner's step before the first cell (:func:`before_cells`).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from rich.console import Console

from dtbench.harness.calibration.calibrate import Point, Settings
from dtbench.harness.calibration.curves import DEFAULT_FACTOR, Curves, auto_budget

if TYPE_CHECKING:
    import torch


def store(
    sessions,
    points: list[Point],
    *,
    run_id: int | None,
    suite_name: str,
    suite_hash: str,
    device: torch.device | str,
    device_name: str | None = None,
) -> str:
    """Write ``points`` as one calibration batch; return the batch id.

    ``device_name``: the measuring worker's (default: :func:`~dtbench.harness.measurement.machine.device_name` of ``device``
    in this process)."""
    from dtbench.harness.measurement import machine
    from dtbench.harness.store.db import Calibration

    batch = uuid.uuid4().hex
    if device_name is None:
        assert not isinstance(device, str), "a device given by name comes with its worker's device_name"
        dev_name = machine.device_name(device)
    else:
        dev_name = device_name
    with sessions() as session:
        for p in points:
            session.add(
                Calibration(
                    run_id=run_id,
                    batch=batch,
                    suite_name=suite_name,
                    suite_hash=suite_hash,
                    device=str(device),
                    device_name=dev_name,
                    **p.__dict__,
                )
            )
        session.commit()
    return batch


# --- n_max: auto ---------------------------------------------------------------------------------------------------


def auto_cells(plan) -> list:
    return [cp for cp in plan.decoders if getattr(cp.params, "n_max", None) == "auto"]


def resolve_auto(plan, curves: Curves, console: Console | None = None) -> dict[str, int]:
    """Replace ``n_max: auto`` in the plan's decoders by :func:`auto_budget` at each decoder's first prompt length
    (one budget per decoder entry); return {label: n_max}."""
    out = {}
    for cp in auto_cells(plan):
        l_max = min(k.l_max for k in cp.points) if cp.points else 0
        factor = float(getattr(cp.params, "n_max_factor", DEFAULT_FACTOR))
        n = auto_budget(curves, l_max, factor)
        cp.params = cp.params.model_copy(update={"n_max": n})
        out[cp.label] = n
        if console is not None:
            console.print(
                f"n_max: auto -> {n} for {cp.label} (tree verify within {factor:g}x one token at L_max={l_max})",
                highlight=False,
            )
    return out


def apply_budgets(plan, budgets: dict[str, int]) -> None:
    """Set ``n_max`` of the plan's decoders named in ``budgets`` ({label: n_max}); the plan's prompt groups hold
    the same decoder entries, so they see it too."""
    for cp in plan.decoders:
        if cp.label in budgets:
            cp.params = cp.params.model_copy(update={"n_max": int(budgets[cp.label])})


def contexts_of(prompts: dict[tuple[str, int], list]) -> dict[int, list[int]]:
    """Cache content per L_max: the first prompt of the first dataset with that cap."""
    out: dict[int, list[int]] = {}
    for (_, l_max), ps in prompts.items():
        if ps and l_max not in out:
            out[l_max] = list(ps[0].token_ids)
    return out


def before_cells(
    sessions, run_id: int, plan, suite, suite_text: str, executor, prompts, console: Console
) -> Curves | None:
    """The runner's step before the first cell: calibrate when the suite asks (``calibrate: true``) or a decoder
    has ``n_max: auto`` — on the ``executor``'s worker (:mod:`dtbench.harness.execution.executors`), reusing the run's stored
    calibration on ``--resume`` — then resolve ``n_max: auto``, record the chosen budgets in the cells' params and
    hand them to the executor's workers."""
    from sqlalchemy import select

    from dtbench.harness.store.db import Calibration, Run
    from dtbench.harness.suites.suitefile import suite_hash

    if not (suite.calibrate or auto_cells(plan)):
        return None
    with sessions() as session:
        rows = session.scalars(select(Calibration).where(Calibration.run_id == run_id)).all()
        curves = Curves(rows, batch=rows[0].batch, run_id=run_id) if rows else None
    if curves is None:
        measured = executor.calibrate(contexts_of(prompts), Settings(), console)
        points = measured.points
        batch = store(
            sessions,
            points,
            run_id=run_id,
            suite_name=suite.name,
            suite_hash=suite_hash(suite_text),
            device=measured.device,
            device_name=measured.device_name,
        )
        with sessions() as session:
            run = session.get(Run, run_id)
            run.environment = {**(run.environment or {}), "calibration": {"batch": batch, **measured.where}}
            session.commit()
        curves = Curves(points, batch=batch, run_id=run_id)
        console.print(
            f"calibration stored: {len(points)} points (batch {batch[:8]}), measured on "
            f"{measured.host} (pid {measured.pid}, {measured.device_name})",
            highlight=False,
        )
    budgets = resolve_auto(plan, curves, console)
    if budgets:
        with sessions() as session:
            for cell in session.get(Run, run_id).cells:
                if cell.label in budgets:
                    cell.params = {**(cell.params or {}), "n_max": budgets[cell.label]}
            session.commit()
        executor.set_budgets(budgets)
    return curves
