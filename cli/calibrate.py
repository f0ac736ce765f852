"""``dtbench calibrate``: measure and store a suite's forward-latency curves (harness/calibration/calibrate.py does the work)."""

from __future__ import annotations

from collections.abc import Iterable

import click
from rich.console import Console

from dtbench.harness.calibration.calibrate import Settings, calibrate
from dtbench.harness.calibration.calibrate_run import contexts_of, store
from dtbench.harness.calibration.curves import Curves
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.bounds import CalibrationSeconds, Checked

# --- the command ------------------------------------------------------------------------------------------------


@click.command("calibrate")
@click.argument("suite_path", type=click.Path(dir_okay=False))
@click.option(
    "--db",
    "db_url",
    help="SQLAlchemy URL or SQLite file of the results database [env DTBENCH_DB; default sqlite:///results.db]",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    envvar="DTBENCH_DATA_DIR",
    help="local dataset folder (the cache is filled with the suite's first prompt) [env DTBENCH_DATA_DIR]",
)
@click.option(
    "--min-time",
    type=Checked(CalibrationSeconds, "SECONDS"),
    default=Settings.min_time_s,
    show_default=True,
    help="seconds each point is timed at least (over all its passes)",
)
@click.option(
    "--max-time",
    type=Checked(CalibrationSeconds, "SECONDS"),
    default=Settings.max_time_s,
    show_default=True,
    help="seconds after which a point's timing stops (over all its passes)",
)
@click.option(
    "--min-repeats",
    type=click.IntRange(1),
    default=Settings.min_repeats,
    show_default=True,
    help="forwards each point is timed at least (over all its passes)",
)
@click.option(
    "--passes",
    type=click.IntRange(1, 20),
    default=Settings.passes,
    show_default=True,
    help="interleaved passes over every point, each in its own seeded random order (a point's median is over all "
    "its visits, so a slow spell of the machine lands on scattered points, not on one curve)",
)
@click.option(
    "--prompt-cache-only",
    is_flag=True,
    help="calibrate on L_max cached positions only (default: also on L_max + T, interpolated between)",
)
@click.option(
    "--export",
    "export_path",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="also write the curves as a portable curves file (JSON: device, versions, model shapes) for "
    "`dtbench report --predict-on FILE` on a run made elsewhere",
)
def calibrate_command(
    suite_path, db_url, data_dir, min_time, max_time, min_repeats, passes, prompt_cache_only, export_path
) -> None:
    """Measure SUITE_PATH's target and draft forward-latency curves and store them (standalone, run_id NULL).

    One forward over n new tokens on a KV cache of the suite's prompt length (and prompt length + T), for
    n = 1 .. the largest tree or chain the suite's decoders build, with and without the tree mask, device-
    synchronized, repeated until the median is stable. `dtbench report --cost-model` uses the newest calibration
    of a run's models, dtype and device; `calibrate: true` in a suite does the same inside `dtbench run`, on the
    worker that measures the cells (this process with --executor local, the first Ray worker with --executor ray).
    """
    from dtbench.harness.data import datasets as data
    from dtbench.harness.data import selection
    from dtbench.harness.models import loading as models
    from dtbench.harness.store import db, engines
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suitefile import load_suite, suite_hash

    if max_time < min_time:
        raise DtbenchError(f"--max-time ({max_time:g}) must be at least --min-time ({min_time:g})")
    if export_path:  # tried before the minutes of calibrating, not after them (issue 59 item 8)
        from dtbench.harness.suites.outpaths import writable_file

        writable_file(export_path, "the curves file")
    suite, text = load_suite(suite_path)
    plan = plan_suite(suite)
    sessions = db.connect(db_url)
    console = Console(stderr=True)
    device = models.resolve_device(suite.device)
    tokenizer = models.load_tokenizer(suite.target)
    prompts = {}
    for ds in suite.datasets:
        docs = data.load_documents(ds, data_dir)
        for l_max in ds.l_maxes:
            prompts[(ds.key, l_max)] = selection.select_prompts(docs, tokenizer, 1, l_max, suite.seed)
    with console.status(f"loading target {suite.target.model} ({suite.target.dtype}) on {device}"):
        target = models.load_model(suite.target, device)
    draft = None
    if suite.draft is not None and any(p.cls.needs_draft for p in plan.decoders):
        with console.status(f"loading draft {suite.draft.model} ({suite.draft.dtype})"):
            draft = models.load_model(suite.draft, device)
    settings = Settings(
        min_repeats=min_repeats,
        min_time_s=min_time,
        max_time_s=max_time,
        passes=passes,
        grown_cache=not prompt_cache_only,
    )
    points = calibrate(plan, suite, target, draft, device, contexts_of(prompts), settings=settings, console=console)
    batch = store(sessions, points, run_id=None, suite_name=suite.name, suite_hash=suite_hash(text), device=device)
    where = engines.display_url(engines.resolve_url(db_url))
    console.print(f"stored {len(points)} calibration points (batch {batch}) in {where}", highlight=False)
    for line in summary_lines(Curves(points)):
        click.echo(line)
    if export_path:
        from dtbench.harness.calibration import curves_file
        from dtbench.harness.execution.worker import model_info
        from dtbench.harness.measurement import machine

        env = machine.environment(device)
        doc = curves_file.document(
            points,
            device=str(device),
            device_name=machine.device_name(device),
            models={"target": model_info(target), "draft": model_info(draft)},
            versions={k: str(env[k]) for k in ("torch", "transformers", "dtbench")},
            source=f"dtbench calibrate {suite.name} (batch {batch[:8]})",
        )
        console.print(f"wrote {curves_file.write(export_path, doc)} (no loop overhead: a calibration runs no loop)")


def summary_lines(curves: Curves) -> Iterable[str]:
    """One line per curve: role, kind, cache length and ms at each n."""
    for (role, kind), per in sorted(curves._table.items()):
        for c, (ns, secs) in sorted(per.items()):
            pts = " ".join(f"{int(n)}:{s * 1e3:.1f}" for n, s in zip(ns, secs))
            yield f"{role:6} {kind:7} cache {c:5}  n:ms  {pts}"
