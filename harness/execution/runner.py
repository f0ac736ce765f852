"""The driver of a run: its lifecycle, the single writer (the sink), its final status.

The plan (:mod:`dtbench.harness.suites.plan`) says what runs in which order; an executor (:mod:`dtbench.harness.execution.executors`)
hands prompt groups to workers (:mod:`dtbench.harness.execution.worker`: the models, measuring one group); the run rows'
ownership, heartbeat and resume checks are :mod:`dtbench.harness.store.runs`. This module drives them: :func:`run_suite`
(load what the plan needs, open the run and its cells, calibrate if asked, execute, close the run with a true
status) and :func:`commit_outcome` (the single writer: each sample is committed at once, so a killed run loses at
most the sample in flight and ``--resume`` continues where it stopped).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from rich.console import Console
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dtbench.core import mask_urls, redact_credentials, redact_json
from dtbench.harness.calibration import calibrate_run
from dtbench.harness.data import chat
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.execution import executors, run_inputs
from dtbench.harness.measurement import load
from dtbench.harness.measurement.cells import Outcome
from dtbench.harness.measurement.measurers import measurer_name
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.models import loading as models
from dtbench.harness.safetext import printable
from dtbench.harness.store.db import Cell, Run, Sample, utcnow
from dtbench.harness.store.runs import Heartbeat, check_resumable, mark_crashed, open_run
from dtbench.harness.suites.bounds import valid_id
from dtbench.harness.suites.grouping import CellKey, GroupKey
from dtbench.harness.suites.plan import Plan, PromptGroup, plan_suite
from dtbench.harness.suites.preflight import preflight
from dtbench.harness.suites.suite import Suite


@contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM like Ctrl-C so a terminated run is marked interrupted, not left 'running'; and make SIGINT
    Ctrl-C again (Python's ``default_int_handler``) for the run, also where the process was started with SIGINT
    ignored (issue 42 item 2: a background job of a non-interactive shell inherits SIG_IGN, and a run then went on
    through a hung server request until its timeout and ended 'completed'). With the default handler in place
    ``asyncio.run`` (the server client, harness/serving/client.py) cancels the requests in flight at once. A run that must
    survive a terminal's Ctrl-C is started with ``setsid`` or ``nohup``, not by relying on an ignored SIGINT."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


class RunInterrupted(DtbenchError):
    """The run was stopped by Ctrl-C or SIGTERM; everything measured so far is stored."""


class RunFailed(DtbenchError):
    """The runner itself failed (not a decoder): the run is stored as ``failed`` and can be resumed."""


def needs_calibration(plan: Plan, suite: Suite) -> bool:
    """Whether the run calibrates before its first cell (``calibrate: true``, or a tree decoder with n_max: auto)."""
    return bool(suite.calibrate or calibrate_run.auto_cells(plan))


def run_suite(
    suite: Suite,
    suite_text: str,
    sessions: sessionmaker[Session],
    *,
    suite_path: str | None = None,
    data_dir: str | None = None,
    resume: int | None = None,
    force: bool = False,
    console: Console | None = None,
    progress: bool = True,
    executor=None,
    quiet_below: float | None = None,
    quiet_limit_s: float = 120.0,
    skip_failed: bool = False,
) -> int:
    """Run a suite and store every sample; return the run id.

    A decoder that raises, exits, yields bad Steps or runs past the per-sample time limit fails its cell (with
    the error) and the run goes on. The run's recorded status is always true: ``completed`` only when every cell
    was attempted; ``interrupted`` on Ctrl-C/SIGTERM; ``failed`` (with the error) when the runner itself failed.
    Both of the latter can be continued with ``resume``, by either executor.

    Args:
        suite, suite_text: the validated suite and its YAML text (stored with the run).
        sessions: a session factory from ``db.connect``.
        data_dir: local dataset folder (else the suite's, ``DTBENCH_DATA_DIR`` or the hub).
        resume: id of an unfinished run of the same suite to continue (completed samples are skipped).
        force: resume even if the run's owner process still looks alive.
        console: where progress goes (stderr by default).
        executor: who measures the prompt groups (:mod:`dtbench.harness.execution.executors`); default a
            :class:`~dtbench.harness.execution.executors.LocalExecutor` in this process. This function stays the only writer.
        quiet_below, quiet_limit_s: ``--require-quiet``: after the suite validated and before anything loads, wait
            up to ``quiet_limit_s`` seconds for the 1-minute load average to drop below ``quiet_below``
            (:func:`dtbench.harness.measurement.load.wait_quiet`), else refuse; None: do not wait.
        skip_failed: a resumed run leaves its failed cells failed (a cell that crashes every time is gone past)
            instead of retrying them.

    Raises:
        DtbenchError: bad suite/models/data, or a machine that did not become quiet (before the run row is
            written); RunInterrupted on Ctrl-C/SIGTERM; RunFailed when the runner itself failed mid-run.
    """
    console = console or Console(stderr=True)
    executor = executor or executors.LocalExecutor()
    plan = plan_suite(suite)
    plan.data_dir = data_dir
    run_inputs.note_skipped_and_plugins(plan, console)
    preflight(suite, plan, console)
    if resume is not None:  # a live or wrong run is refused now, not after the models loaded
        _check_resume(sessions, resume, suite_text, force, console)
    quiet = None
    if quiet_below is not None:  # before anything loads: dtbench's own loading would raise the load it waits on
        found = load.wait_quiet(
            quiet_below, quiet_limit_s, say=lambda line: console.print(f"note: {line}", markup=False, highlight=False)
        )
        quiet = {"below": quiet_below, "load_1m": round(found, 3), "limit_s": quiet_limit_s}
    try:
        executor.prepare(suite)  # the device exists (local), Ray is reachable (ray)

        # Everything cheap and fallible first: tokenizers, vocabulary, prompts. Then the models, on every worker.
        tokenizer = models.load_tokenizer(suite.target)
        if suite.draft is not None and suite.draft.model != suite.target.model:
            models.check_tokenizers(
                tokenizer, models.load_tokenizer(suite.draft), suite.target.model, suite.draft.model
            )
        prompts, sources = run_inputs.load_prompts(suite, tokenizer, data_dir)
        info = executor.start(suite, plan, tokenizer, console)
        for warning in info.warnings:
            console.print(f"warning: {printable(warning)}", style="yellow", markup=False, highlight=False)

        env = run_inputs.run_environment(
            info.environment, executor.describe(), quiet, sources, suite, prompts, tokenizer
        )
        with sessions() as session:
            run = open_run(session, suite, suite_text, suite_path, resume, force, env)
            run_id = run.id
            cells = _open_cells(session, run, plan, info.target, info.draft, retry_failed=not skip_failed)
            session.commit()

        status = _measure(sessions, run_id, plan, suite, suite_text, executor, prompts, cells, console, progress)
    finally:
        executor.close()  # workers stop (Ray actors killed, Ray shut down if this run started it)
    if status == "interrupted":
        raise RunInterrupted(
            f"run {run_id} interrupted; measured samples are kept (continue with --resume-run {run_id})"
        )
    return run_id


def _measure(sessions, run_id: int, plan, suite, suite_text, executor, prompts, cells, console, progress: bool) -> str:
    """Measure every prompt group of the open run ``run_id`` through ``executor`` (after the calibration where the
    suite asks for one) under a heartbeat and the progress bar, then close the run with its status; returns it
    (``completed`` or ``interrupted``).

    Raises:
        RunFailed: the runner itself failed (the run is closed as failed, its samples kept).
    """
    status, error = "failed", None
    heartbeat = Heartbeat(sessions, run_id)
    try:
        with (
            _sigterm_as_interrupt(),
            heartbeat,
            run_inputs.progress_bar(console, progress) as bar,
        ):
            # calibrate: true / n_max: auto (issue 12): measured on the executor's (first) worker, stored with
            # the run by this process, auto budgets resolved in the plan and handed to every worker.
            if needs_calibration(plan, suite):
                calibrate_run.before_cells(sessions, run_id, plan, suite, suite_text, executor, prompts, console)
            task = bar.add_task("starting", total=plan.n_samples)
            sink = _Sink(sessions, run_id, cells, prompts, bar, task, console, suite.repeats)
            executor.execute(plan.groups(), sink)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
    except BaseException as exc:
        error = clip(f"{type(exc).__name__}: {exc}", 2000)
        raise RunFailed(
            f"run {run_id} failed: {clip(error, 300)}; measured samples are kept (continue with --resume-run {run_id})"
        ) from exc
    finally:
        _close_run(sessions, run_id, status, error, console)
    return status


def _check_resume(sessions, resume: int, suite_text: str, force: bool, console: Console) -> None:
    """Refuse a run that cannot be resumed (:func:`~dtbench.harness.store.runs.check_resumable`), after recording
    one whose process died without closing it as crashed, its in-flight cell failed (issue 50, with a note).

    Raises:
        DtbenchError: one line saying why the run cannot be resumed.
    """
    with sessions() as session:
        resumed = session.get(Run, resume) if valid_id(resume) else None
        crashed = mark_crashed(resumed) if resumed is not None else None
        if crashed:
            session.commit()
            console.print(f"note: {printable(crashed)}", style="yellow", markup=False, highlight=False)
        check_resumable(resumed, resume, suite_text, force)


class _Sink:
    """The driver's side of an executor (:class:`dtbench.harness.execution.executors.Sink`): reads what a prompt group has
    stored before it is dispatched, commits each outcome (the single writer) and moves the progress bar.

    Every (group, decoder) advances the bar exactly once: when found stored or failed, when committed, or when
    dropped. An outcome of a cell that failed meanwhile on another worker is dropped, so a cell that failed holds
    the same samples as under the local executor (which never measures a failed cell again).
    """

    def __init__(self, sessions, run_id: int, cells, prompts, bar, task, console: Console, repeats: int = 1):
        self.sessions, self.run_id, self.cells, self.prompts = sessions, run_id, cells, prompts
        self.bar, self.task, self.console = bar, task, console
        self.repeats = repeats
        self.counted: dict[GroupKey, set[str]] = {}  # labels counted on the bar, per unit of work
        self.failed_cells: set[int] = set()

    def _where(self, group: PromptGroup) -> str:
        repeats = max(self.repeats, group.repeats)
        again = f" · repeat {group.repeat + 1}/{repeats}" if repeats > 1 and not group.warmup else ""
        if group.multi:
            rows = group.prompt_indices
            return (
                f"{group.dataset.key} L_max={group.l_max} T={group.gen_length} B={group.batch_size} · prompts "
                f"{rows[0] + 1}-{rows[-1] + 1}/{group.dataset.prompts}{again}"
            )
        return (
            f"{group.dataset.key} L_max={group.l_max} T={group.gen_length} · prompt "
            f"{group.prompt_index + 1}/{group.dataset.prompts}{again}"
        )

    def _count(self, group: PromptGroup, labels, description: str) -> None:
        seen = self.counted.setdefault(group.key, set())
        new = set(labels) - seen
        seen |= new
        self.bar.update(self.task, advance=len(new) * len(group.prompt_indices), description=description)

    def _cell(self, group: PromptGroup, label: str) -> int:
        return self.cells[group.cell][label]

    def prompt(self, group: PromptGroup):
        if group.multi:  # raw-text prompts only (the plan refuses question datasets at B > 1)
            return [self.prompts[(group.dataset.key, group.l_max)][i] for i in group.prompt_indices]
        # A later turn of a question is rendered now, from the reference's stored answers to the earlier turns.
        return chat.resolve(
            self.prompts[(group.dataset.key, group.l_max)],
            group.prompt_index,
            lambda index: _reference_output(self.sessions, self.cells, group, index),
        )

    def state(self, group: PromptGroup):
        done, failed = _group_state(self.sessions, self.cells, group)
        self._count(group, [*done, *failed], self._where(group))
        return done, failed

    def commit(self, group: PromptGroup, outcome: Outcome, worker) -> None:
        cell_id = self._cell(group, outcome.label)
        if cell_id not in self.failed_cells:
            commit_outcome(self.sessions, self.run_id, cell_id, outcome, worker.extra if outcome.rows else None)
            if outcome.rows is None:
                self.failed_cells.add(cell_id)
        self._count(group, [outcome.label], f"{self._where(group)} · {outcome.label} done")

    def fail(self, group: PromptGroup, error: str, worker) -> None:
        done, failed = _group_state(self.sessions, self.cells, group)
        for cp in group.decoders:
            if cp.label not in done and cp.label not in failed:
                self.commit(group, Outcome(cp.label, error=error), worker)
        self._count(group, [cp.label for cp in group.decoders], self._where(group))

    def note(self, text: str) -> None:
        self.console.print(text, style="yellow", markup=False, highlight=False)

    def started(self, group: PromptGroup, label: str) -> None:
        """Record the cell being measured now (``runs.measuring_cell_id``): if this process dies, the next
        ``--resume`` or ``report`` fails that cell (:func:`~dtbench.harness.store.runs.mark_crashed`)."""
        with self.sessions() as session:
            session.get(Run, self.run_id).measuring_cell_id = self._cell(group, label)
            session.commit()


def _close_run(sessions, run_id: int, status: str, error: str | None, console: Console) -> None:
    """Record the run's final status; cells not failed become done (completed run), or, to resume, interrupted
    (holding samples) or pending (none yet)."""
    try:
        with sessions() as session:
            run = session.get(Run, run_id)
            run.status, run.error = status, error
            run.finished_at = utcnow()
            run.measuring_cell_id = None
            for cell in run.cells:
                if cell.status == "failed":
                    continue
                if status == "completed":
                    cell.status = "done"
                else:  # cells holding samples are interrupted, the others not started (issue 50 item D)
                    cell.status = "interrupted" if cell.status in ("running", "interrupted") else "pending"
            session.commit()
    except Exception as exc:  # the database itself is failing: the run stays 'running' with a stale heartbeat
        console.print(
            f"could not record run {run_id} as {status}: {type(exc).__name__}: {printable(clip(exc))}",
            style="red",
            markup=False,
            highlight=False,
        )


def _open_cells(
    session, run, plan: Plan, target: dict[str, Any], draft: dict[str, Any] | None, retry_failed: bool = True
) -> dict[CellKey, dict[str, int]]:
    """The run's cells, written where new (the runner names each one's measurer: ``local`` or ``served``, issue 49;
    issue 58 item 4: no store hook), reopened where resumed; their ids by point
    (:class:`~dtbench.harness.suites.grouping.CellKey`) and label."""
    existing = {(CellKey.of_row(c), c.label): c for c in run.cells}
    ids: dict[CellKey, dict[str, int]] = {}
    for ds, l_max, T, B, cp in plan.cells():
        key = CellKey(ds.key, l_max, T, B)
        cell = existing.get((key, mask_urls(cp.label)))  # stored masked (issue 50 item 2)
        if cell is None:
            cell = Cell(
                run=run,
                dataset=ds.key,
                l_max=l_max,
                gen_length=T,
                batch_size=B,
                execution=cp.execution,
                decoder=cp.spec.name,
                family=cp.cls.family,
                measurer=measurer_name(cp.cls),  # local or served: stored, never guessed by a report (issue 49)
                label=mask_urls(cp.label),  # labels name params: masked like them (issue 50)
                decoder_version=str(cp.version),
                decoder_distribution=cp.distribution,
                params=redact_json(
                    cp.params.model_dump(mode="json"), by_value=False
                ),  # URL credentials masked (issue 42)
                lossless_expected=cp.cls.lossless_with(cp.params),
                lossless_check=plan.suite.lossless_check,
                sweep_group=mask_urls(cp.spec.sweep_group) if cp.spec.sweep_group else None,
                swept=redact_json(cp.spec.swept, by_value=False) or None,
                sampling=cp.sampling.model_dump(mode="json") if cp.sampling else None,
                reference_label=mask_urls(cp.reference_label) if cp.reference_label else None,
                target_model=f"{target['model']} ({target['dtype']})",
                draft_model=f"{draft['model']} ({draft['dtype']})" if (draft and cp.cls.needs_draft) else None,
            )
            session.add(cell)
        elif cell.status == "failed" and retry_failed:
            cell.status, cell.error = "pending", None  # a resumed run retries failed cells (not with --skip-failed)
        elif cell.status == "interrupted":
            cell.status = "running"  # it holds samples
        session.flush()
        ids.setdefault(key, {})[cp.label] = cell.id
    return ids


def _group_state(sessions, cells, group: PromptGroup) -> tuple[dict[str, Reference], set[str]]:
    """(stored outputs by label, failed labels) of one prompt group, from the database."""
    done: dict[str, Reference] = {}
    failed: set[str] = set()
    with sessions() as session:
        for cp in group.decoders:
            cell = session.get(Cell, cells[group.cell][cp.label])
            if cell.status == "failed":
                failed.add(cp.label)
                continue
            if group.multi:  # a batch's rows are committed together: all stored or none
                rows = session.scalars(
                    select(Sample)
                    .where(
                        Sample.cell_id == cell.id,
                        Sample.prompt_index.in_(group.prompt_indices),
                        Sample.repeat == group.repeat,
                    )
                    .order_by(Sample.prompt_index)
                ).all()
                if rows:  # committed (a served unit keeps the rows of the requests that did not fail: issue 59)
                    prompts = tuple(r.prompt_index for r in rows)
                    done[cp.label] = Reference([r.output_tokens for r in rows], rows[0].batch_total_s, None, prompts)
                continue
            sample = session.scalar(
                select(Sample).where(
                    Sample.cell_id == cell.id, Sample.prompt_index == group.prompt_index, Sample.repeat == group.repeat
                )
            )
            if sample is not None:
                done[cp.label] = Reference([sample.output_tokens], sample.total_s)
    return done, failed


def _reference_output(sessions, cells, group: PromptGroup, index: int) -> list[int] | None:
    """The stored output tokens of the group's reference decoder (its first decoder without a reference: ``ar``)
    for prompt ``index`` of the same (dataset, L_max, T), its first repeat, or None."""
    ref = next(cp for cp in group.decoders if not cp.reference_label)
    with sessions() as session:
        return session.scalar(
            select(Sample.output_tokens)
            .where(
                Sample.cell_id == cells[group.cell][ref.label],
                Sample.prompt_index == index,
            )
            .order_by(Sample.repeat)
            .limit(1)
        )


def commit_outcome(sessions, run_id: int, cell_id: int, outcome: Outcome, extra: dict[str, Any] | None = None) -> None:
    """Store one outcome at once (the single writer): the sample, or the cell's failure; refresh the heartbeat; fold
    the machine's load during it into the cell's load columns (:func:`dtbench.harness.measurement.load.merge`).

    Every string stored (a sample's ``step_stats``, a cell's error) has its URL credentials masked
    (:func:`dtbench.core.redact_json`): a server's ``base_url`` with a password is stored as ``user:***@``."""

    with sessions() as session:
        cell = session.get(Cell, cell_id)
        if outcome.load:
            for key, value in load.merge({k: getattr(cell, k) for k in load.COLUMNS}, outcome.load).items():
                setattr(cell, key, value)
        if outcome.rows is not None:
            for row in outcome.rows:  # a batch's rows in one transaction; each record mapped to the ORM once
                session.add(Sample(cell_id=cell_id, **redact_json(replace(row, **(extra or {})).as_row())))
            if cell.status == "pending":
                cell.status = "running"
            if outcome.compile_s is not None:  # a compiled cell's compile step, before its first sample
                if cell.compile_s is None:  # the first one stays (a resumed run compiles again: issue 50 item D)
                    cell.compile_s, cell.compile_graphs = outcome.compile_s, outcome.compile_graphs
                cell.compile_runs = [*(cell.compile_runs or []), [outcome.compile_s, outcome.compile_graphs]]
        else:
            cell.status, cell.error = "failed", redact_credentials(outcome.error or "")[:2000]
        run = session.get(Run, run_id)
        run.heartbeat_at, run.measuring_cell_id = utcnow(), None
        session.commit()


def make_executor(
    name: str,
    *,
    address: str | None = None,
    workers: int | None = None,
    threads_per_worker: int | None = None,
    connect_timeout_s: float | None = None,
) -> executors.Executor:
    """The executor named by ``dtbench run --executor``: the class registered under that name in the entry-point
    group ``dtbench.executors``, built by its :meth:`~dtbench.harness.execution.executors.Executor.from_options`.

    Raises:
        DtbenchError: an unknown, ambiguous or broken executor, Ray options given to the local executor, or Ray not
            installed.
    """
    cls = executors.REGISTRY.get(name)  # the entry-point group dtbench.executors (local, ray, a plugin's)
    return cls.from_options(
        address=address, workers=workers, threads_per_worker=threads_per_worker, connect_timeout_s=connect_timeout_s
    )
