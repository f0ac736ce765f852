"""A served cell's requests after warmup, as the reports count them (issue 59 item 7; split from
:mod:`dtbench.reports.views.engine` in issue 67 so the default report's summary counts failed requests without importing
the load view): each unit's load profile once, the requests sent and failed.
"""

from __future__ import annotations

import json
import math

from dtbench.reports import loading
from dtbench.reports.stats import served


def unit_loads(server: list[dict]) -> list[dict]:
    """The distinct load profiles (``cell_load``, :func:`dtbench.harness.serving.load_profile`) among a cell's
    requests' ``step_stats.server``: one per unit of work (a cell's measured prompts, per repeat); [] for a server
    cell measured before issue 39 and for dtbench's own decoders."""
    units = {json.dumps(st["cell_load"], sort_keys=True): st["cell_load"] for st in server if st.get("cell_load")}
    return list(units.values())


def served_stats(session, run_id: int) -> dict[int, list[dict]]:
    """Per server cell of a run, its samples' ``step_stats.server`` after warmup."""
    ids = [cell.id for cell in loading.run_cells(session, run_id) if served(cell.measurer)]
    rows = loading.sample_values(session, ids, "step_stats")
    by_cell: dict[int, list[dict]] = {}
    for cell_id, stats in rows:
        by_cell.setdefault(cell_id, []).append((stats or {}).get("server") or {})
    return by_cell


def failure_counts(server: list[dict], is_server: bool) -> dict:
    """A server cell's requests after warmup (issue 59 item 7): ``requests`` sent, ``failed`` and ``failure_rate``,
    summed over its units (``cell_load.requests`` / ``cell_load.failed``, each unit once). A cell measured before
    issue 59 kept no unit that lost a request: its rows are its requests, none failed. NaN for dtbench's own
    decoders (they send no requests)."""
    if not is_server:
        return {"requests": math.nan, "failed": math.nan, "failure_rate": math.nan}
    loads = unit_loads(server)
    if loads and all("requests" in u for u in loads):
        sent, failed = sum(int(u["requests"]) for u in loads), sum(int(u["failed"]) for u in loads)
    else:
        sent, failed = len(server), 0
    return {"requests": sent, "failed": failed, "failure_rate": failed / sent if sent else math.nan}
