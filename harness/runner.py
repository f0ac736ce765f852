"""Run orchestration: load what the plan needs, execute its prompt groups, store every outcome, keep the run's
status true.

The plan (harness/plan.py) says what runs in which order; measure.py times one decoder on one prompt; metrics.py
turns that into a samples row; this module drives them: :func:`measure_one` (one cell x prompt, never raising for a
decoder's fault), :func:`run_group` (one prompt group, references first), :func:`commit_outcome` (the single
writer: each sample is committed at once, so a killed run loses at most the sample in flight and ``--resume``
continues where it stopped), run ownership and heartbeat, and the run's final status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dtbench.harness import calibrate, chat, data, lossless, models, questions, registry
from dtbench.harness.bounds import valid_id
from dtbench.harness.db import Cell, Run, Sample, utcnow
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.measure import Measurement, SampleTimeout, environment, measure  # noqa: F401  (re-exported)
from dtbench.harness.metrics import first_divergence, sample_row  # noqa: F401  (re-exported)
from dtbench.harness.plan import CellPlan, Plan, PromptGroup, plan_suite, preflight  # noqa: F401  (re-exported)
from dtbench.harness.suite import Suite
from dtbench.harness.suitefile import suite_hash


@contextmanager
def _sigterm_as_interrupt():
    """Treat SIGTERM like Ctrl-C so a terminated run is marked interrupted, not left 'running'."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class RunInterrupted(DtbenchError):
    """The run was stopped by Ctrl-C or SIGTERM; everything measured so far is stored."""


class RunFailed(DtbenchError):
    """The runner itself failed (not a decoder): the run is stored as ``failed`` and can be resumed."""


HEARTBEAT_S = 30.0  # a running run refreshes runs.heartbeat_at this often (and at every committed sample)
STALE_S = 300.0  # a run of another host whose heartbeat is older than this is taken as dead
AUTO_TIMEOUT_FACTOR, AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_REFERENCE_S = 10.0, 60.0, 1800.0


def needs_calibration(plan: Plan, suite: Suite) -> bool:
    """Whether the run calibrates before its first cell (``calibrate: true``, or a tree decoder with n_max: auto)."""
    return bool(suite.calibrate or calibrate._auto_cells(plan))


def sample_timeout(setting: float | str | None, reference_s: float | None) -> float | None:
    """The time limit of one sample in seconds (suite ``timeout_s``).

    ``auto``: 10x the reference decoder's time on the same prompt, at least 60 s; a reference itself (or a
    decoder whose reference time is unknown) gets 1800 s. A number is used as is; None means no limit.
    """
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if reference_s is None:
        return AUTO_TIMEOUT_REFERENCE_S
    return max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * reference_s)


def cpu_timeout(setting: float | str | None, reference_s: float | None, reference_cpu_s: float | None
                ) -> tuple[float | None, float | None]:
    """(wall limit, CPU limit) of one sample in seconds: ``auto`` measured in CPU time when the reference's is known.

    On a shared machine the wall time of a sample stretches with whatever else runs, so ``10x the reference's wall
    time`` failed cells that would have finished when the load rose between the reference and the decoder (issue
    19: ``hf_assisted`` past 60 s while ``ar`` took 4.2 s). The process's CPU time does not stretch with the load:
    ``auto`` with the reference's CPU time gives the decoder 10x that (at least 60 s) of CPU time, and keeps a wall
    limit of max(1800 s, 10x the reference's wall time) for a decoder that blocks without computing. A number, None,
    or a reference measured without CPU time (a resumed run's stored samples): :func:`sample_timeout`, wall only.
    """
    if setting != "auto" or reference_s is None or reference_cpu_s is None:
        return sample_timeout(setting, reference_s), None
    return (max(AUTO_TIMEOUT_REFERENCE_S, AUTO_TIMEOUT_FACTOR * reference_s),
            max(AUTO_TIMEOUT_MIN_S, AUTO_TIMEOUT_FACTOR * reference_cpu_s))


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
        executor: who measures the prompt groups (:mod:`dtbench.harness.executors`); default a
            :class:`~dtbench.harness.executors.LocalExecutor` in this process. This function stays the only writer.

    Raises:
        DtbenchError: bad suite/models/data (before the run row is written); RunInterrupted on Ctrl-C/SIGTERM;
            RunFailed when the runner itself failed mid-run.
    """
    from dtbench.harness.executors import LocalExecutor

    console = console or Console(stderr=True)
    executor = executor or LocalExecutor()
    plan = plan_suite(suite)
    plan.data_dir = data_dir
    for label in plan.skipped:
        console.print(f"[yellow]note: optional decoder '{label}' is not installed; skipped[/yellow]")
    for line in registry.scan().warnings("decoder"):
        console.print(f"[yellow]warning: {line}[/yellow]")
    preflight(suite, plan, console)
    if resume is not None:  # a live or wrong run is refused now, not after the models loaded
        with sessions() as session:
            _check_resumable(session.get(Run, resume) if valid_id(resume) else None, resume, suite_text, force)
    try:
        executor.prepare(suite)  # the device exists (local), Ray is reachable (ray)

        # Everything cheap and fallible first: tokenizers, vocabulary, prompts. Then the models, on every worker.
        tokenizer = models.load_tokenizer(suite.target)
        if suite.draft is not None and suite.draft.model != suite.target.model:
            models.check_tokenizers(tokenizer, models.load_tokenizer(suite.draft), suite.target.model,
                                    suite.draft.model)
        prompts: dict[tuple[str, int], list[data.Prompt]] = {}
        for ds in suite.datasets:
            docs = data.load_documents(ds, data_dir)
            if data.sample_slots(ds, suite.seed, data_dir) is not None:  # questions: chat prompts, turns (issue 21)
                for cap in ds.caps:
                    prompts[(ds.name, cap)] = questions.prompts(ds, cap, tokenizer, suite, data_dir)
                continue
            for cap in ds.caps:
                prompts[(ds.name, cap)] = data.select_prompts(docs, tokenizer, ds.prompts, cap, suite.seed)
        info = executor.start(suite, plan, tokenizer, console)
        for warning in info.warnings:
            console.print(f"[yellow]warning: {warning}[/yellow]")

        env = dict(info.environment)
        env["executor"] = executor.describe()
        env["datasets"] = data.provenance(suite.datasets)  # hub id/config/split/revision or local files + sha256
        if any(isinstance(p, chat.ChatPrompts) for p in prompts.values()):
            env["chat"] = chat.describe(*chat.suite_template(suite, tokenizer), suite.system_prompt)
        with sessions() as session:
            run = _open_run(session, suite, suite_text, suite_path, resume, force, env)
            run_id = run.id
            cells = _open_cells(session, run, plan, info.target, info.draft)
            session.commit()

        status, error = "failed", None
        heartbeat = _Heartbeat(sessions, run_id)
        try:
            with _sigterm_as_interrupt(), heartbeat, Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), console=console, disable=not progress, transient=False,
            ) as bar:
                # calibrate: true / n_max: auto (issue 12): measured on the executor's (first) worker, stored with
                # the run by this process, auto budgets resolved in the plan and handed to every worker.
                if needs_calibration(plan, suite):
                    calibrate.before_cells(sessions, run_id, plan, suite, suite_text, executor, prompts, console)
                task = bar.add_task("starting", total=plan.n_samples)
                sink = _Sink(sessions, run_id, cells, prompts, bar, task, console)
                executor.execute(plan.groups(), sink)
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
        except BaseException as exc:
            error = clip(f"{type(exc).__name__}: {exc}", 2000)
            raise RunFailed(f"run {run_id} failed: {clip(error, 300)}; measured samples are kept "
                            f"(continue with --resume-run {run_id})") from exc
        finally:
            _close_run(sessions, run_id, status, error, console)
    finally:
        executor.close()  # workers stop (Ray actors killed, Ray shut down if this run started it)
    if status == "interrupted":
        raise RunInterrupted(f"run {run_id} interrupted; measured samples are kept (continue with --resume-run {run_id})")
    return run_id


class _Sink:
    """The driver's side of an executor (:class:`dtbench.harness.executors.Sink`): reads what a prompt group has
    stored before it is dispatched, commits each outcome (the single writer) and moves the progress bar.

    Every (group, decoder) advances the bar exactly once: when found stored or failed, when committed, or when
    dropped. An outcome of a cell that failed meanwhile on another worker is dropped, so a cell that failed holds
    the same samples as under the local executor (which never measures a failed cell again).
    """

    def __init__(self, sessions, run_id: int, cells, prompts, bar, task, console: Console):
        self.sessions, self.run_id, self.cells, self.prompts = sessions, run_id, cells, prompts
        self.bar, self.task, self.console = bar, task, console
        self.counted: dict[tuple, set[str]] = {}
        self.failed_cells: set[int] = set()

    def _where(self, group: PromptGroup) -> str:
        return (f"{group.dataset.name} L_max={group.cap} T={group.gen_length} · prompt "
                f"{group.prompt_index + 1}/{group.dataset.prompts}")

    def _count(self, group: PromptGroup, labels, description: str) -> None:
        seen = self.counted.setdefault((group.dataset.name, group.cap, group.gen_length, group.prompt_index), set())
        new = set(labels) - seen
        seen |= new
        self.bar.update(self.task, advance=len(new), description=description)

    def _cell(self, group: PromptGroup, label: str) -> int:
        return self.cells[(group.dataset.name, group.cap, group.gen_length, label)]

    def prompt(self, group: PromptGroup):
        # A later turn of a question is rendered now, from the reference's stored answers to the earlier turns.
        return chat.resolve(self.prompts[(group.dataset.name, group.cap)], group.prompt_index,
                            lambda index: _reference_output(self.sessions, self.cells, group, index))

    def state(self, group: PromptGroup):
        done, failed = _group_state(self.sessions, self.cells, group)
        self._count(group, [*done, *failed], self._where(group))
        return done, failed

    def commit(self, group: PromptGroup, outcome: Outcome, worker) -> None:
        cell_id = self._cell(group, outcome.label)
        if cell_id not in self.failed_cells:
            commit_outcome(self.sessions, self.run_id, cell_id, outcome, worker.extra if outcome.row else None)
            if outcome.row is None:
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


def _close_run(sessions, run_id: int, status: str, error: str | None, console: Console) -> None:
    """Record the run's final status; cells not failed become done (completed run) or pending (to resume)."""
    try:
        with sessions() as session:
            run = session.get(Run, run_id)
            run.status, run.error = status, error
            run.finished_at = utcnow()
            for cell in run.cells:
                if cell.status != "failed":
                    cell.status = "done" if status == "completed" else "pending"
            session.commit()
    except Exception as exc:  # the database itself is failing: the run stays 'running' with a stale heartbeat
        console.print(f"[red]could not record run {run_id} as {status}: {type(exc).__name__}: {clip(exc)}[/red]")


class _Heartbeat:
    """Refreshes ``runs.heartbeat_at`` every HEARTBEAT_S seconds from a daemon thread while a run is measured."""

    def __init__(self, sessions, run_id: int):
        self.sessions, self.run_id = sessions, run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="dtbench-heartbeat")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with self.sessions() as session:
                    session.get(Run, self.run_id).heartbeat_at = utcnow()
                    session.commit()
            except Exception:  # a busy database must not kill the run; the next beat retries
                pass

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _aware(t):
    from datetime import timezone

    return t if t is None or t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def owner_alive(run: Run) -> str | None:
    """Why ``run`` still looks owned by a live process (a one-line reason), or None if it is free to resume.

    Same host: the owner pid exists and that process started before the run's last heartbeat (a reused pid
    started later). Another host: a heartbeat younger than STALE_S seconds.
    """
    if run.status != "running" or run.owner_pid is None:
        return None
    beat = _aware(run.heartbeat_at)
    age = (utcnow() - beat).total_seconds() if beat is not None else None
    if run.owner_host == socket.gethostname():
        try:
            proc = psutil.Process(run.owner_pid)
            started = proc.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        if beat is not None and started > beat.timestamp() + 1:
            return None
        return f"its owner, pid {run.owner_pid} on this host, is still running"
    if age is not None and age < STALE_S:
        return f"its owner on host {run.owner_host} (pid {run.owner_pid}) sent a heartbeat {age:.0f} s ago"
    return None


_RESUME_MUST_MATCH = ("dtbench", "torch", "transformers", "device", "device_name", "target", "draft")


def _check_resumable(run: Run | None, resume: int, suite_text: str, force: bool) -> None:
    """Refuse to resume a missing or completed run, one of another suite, or one whose owner is alive.

    ``--force`` takes over a run whose owner cannot be checked from here (another host, heartbeat under 5 minutes
    old); a live owner on this host is never taken over: two processes would write the same samples (the second
    failing on the unique constraint) and leave the run's owner pointing at whichever died last.
    """
    if run is None:
        raise DtbenchError(f"no run {resume} to resume")
    if run.status == "completed":
        raise DtbenchError(f"run {resume} is completed; nothing to resume")
    if run.suite_hash != suite_hash(suite_text):
        raise DtbenchError(f"run {resume} was made from a different suite text ({run.suite_name}); cannot resume it with this one")
    alive = owner_alive(run)
    if alive and run.owner_host == socket.gethostname():
        raise DtbenchError(f"run {resume} is still being written: {alive}; wait for it or stop it (kill "
                           f"{run.owner_pid}), then resume (--force takes over only an owner on another host)")
    if alive and not force:
        raise DtbenchError(f"run {resume} is still being written: {alive}; wait for it, or take it over with --force")


def _open_run(session, suite, suite_text, suite_path, resume, force, env: dict[str, Any]) -> Run:
    """A new run, or the run to resume (checked: same suite text, owner gone, same measuring environment).

    ``env``: the measuring worker's environment (versions, device, target/draft) plus the executor's description.
    """
    owner = dict(owner_host=socket.gethostname(), owner_pid=os.getpid(), heartbeat_at=utcnow())
    if resume is None:
        run = Run(suite_name=suite.name, suite_path=suite_path, suite_text=suite_text, suite_hash=suite_hash(suite_text),
                  status="running", environment=env, **owner)
        session.add(run)
        session.flush()
        return run
    run = session.get(Run, resume) if valid_id(resume) else None
    _check_resumable(run, resume, suite_text, force)
    # Samples of one run must come from one environment, or its comparisons mean nothing.
    changed = [k for k in _RESUME_MUST_MATCH if run.environment.get(k) != env.get(k)]
    if changed:
        k = changed[0]
        raise DtbenchError(f"run {resume} was measured with {k} = {run.environment.get(k)!r}, this machine has "
                           f"{env.get(k)!r}; start a new run instead of resuming")
    run.status, run.error = "running", None
    run.finished_at = None
    for key, value in owner.items():
        setattr(run, key, value)
    return run


def _open_cells(session, run, plan: Plan, target: dict[str, Any], draft: dict[str, Any] | None
                ) -> dict[tuple[str, int, int, str], int]:
    existing = {(c.dataset, c.l_max, c.gen_length, c.label): c for c in run.cells}
    ids = {}
    for ds, cap, T, cp in plan.cells():
        key = (ds.name, cap, T, cp.label)
        cell = existing.get(key)
        if cell is None:
            cell = Cell(
                run=run, dataset=ds.name, l_max=cap, gen_length=T, decoder=cp.spec.name,
                label=cp.label, decoder_version=str(cp.version), decoder_distribution=cp.distribution,
                params=cp.params.model_dump(mode="json"), lossless_expected=cp.cls.lossless,
                lossless_check=plan.suite.lossless_check,
                sweep_group=cp.spec.sweep_group, swept=cp.spec.swept or None,
                sampling=cp.sampling.model_dump(mode="json") if cp.sampling else None,
                reference_label=cp.reference_label,
                target_model=f"{target['model']} ({target['dtype']})",
                draft_model=f"{draft['model']} ({draft['dtype']})" if (draft and cp.cls.needs_draft) else None,
            )
            session.add(cell)
        elif cell.status == "failed":
            cell.status, cell.error = "pending", None  # a resumed run retries failed cells
        session.flush()
        ids[key] = cell.id
    return ids


@dataclass
class Outcome:
    """The result of one (cell, prompt): a samples row, or the error that fails the cell.

    ``row`` is a dict of ``samples`` columns (plain JSON-able values, so an executor can ship it between processes).
    """

    label: str
    row: dict[str, Any] | None = None
    error: str | None = None
    cpu_s: float | None = None  # the process's CPU seconds during the sample (the next decoders' timeout yardstick)


def measure_one(cp: CellPlan, prompt, T: int, warmup: bool, ref: tuple[list[int], float] | None, target, draft,
                device, suite: Suite, compare: bool = True, stop_at_eos: bool = False) -> Outcome:
    """Measure one decoder on one prompt; never raises for what the decoder does wrong.

    Anything the decoder does wrong — raising, calling ``sys.exit``, yielding Steps that cannot become a sample,
    running past the time limit — comes back as an :class:`Outcome` with the error; only Ctrl-C propagates.

    Args:
        cp: the decoder's plan entry; prompt: a :class:`~dtbench.harness.data.Prompt`; T: tokens to generate.
        ref: the reference decoder's (tokens, total seconds) on this prompt, or None for a reference itself.
        compare: check the output token for token against the reference's (False when either samples: a sampled
            output is checked as a distribution, by the tests, never against one draw).
        stop_at_eos: end the generation at the target's first EOS (:func:`models.eos_token_id`), T at most.
        target, draft: :class:`~dtbench.harness.models.LoadedModel` (draft may be None).
    """
    if cp.reference_label and ref is None:
        return Outcome(cp.label, error=f"reference decoder '{cp.reference_label}' has no output for prompt "
                                       f"{prompt.index}")
    timeout, cpu_limit = cpu_timeout(suite.timeout_s, ref[1] if ref else None,
                                     ref[2] if ref and len(ref) > 2 else None)
    try:
        torch.manual_seed(suite.seed)
        decoder = cp.cls(target.model, draft.model if (draft and cp.cls.needs_draft) else None, cp.params)
        if cp.sampling is not None:
            decoder.sampling, decoder.generator = sampling_for(cp.sampling, suite.seed, prompt.index, device)
        if stop_at_eos:
            decoder.eos_token_id = models.eos_token_id(target.model)
        m = measure(decoder, prompt.token_ids, T, device, timeout_s=timeout, cpu_timeout_s=cpu_limit)
        row = sample_row(m, prompt, warmup, ref[0] if ref and compare else None)
        if cp.cls.lossless and cp.sampling is None:  # every emitted token checked, outside the timed region
            row.update(lossless.sample_columns(target.model, prompt.token_ids, row, ref[0] if ref and compare else None,
                                               device, suite.lossless_check))
        json.dumps(row)  # the JSON columns must serialize: a bad Step is the decoder's failure, not the run's
    except KeyboardInterrupt:
        raise
    except SampleTimeout:
        cpu = f" ({cpu_limit:g} s of CPU time, 10x the reference's, or {timeout:g} s)" if cpu_limit else f" {timeout:g} s"
        return Outcome(cp.label, error=f"prompt {prompt.index}: timed out after{cpu}")
    except (Exception, SystemExit) as exc:  # a decoder failing mid-run fails its cell, never the run
        kind = "SystemExit (the decoder called sys.exit)" if isinstance(exc, SystemExit) else type(exc).__name__
        return Outcome(cp.label, error=f"prompt {prompt.index}: {kind}: {clip(exc, 1500)}")
    return Outcome(cp.label, row=row, cpu_s=m.cpu_s)


def sampling_for(spec, suite_seed: int, prompt_index: int, device) -> tuple[Any, torch.Generator]:
    """(SamplingSettings, a generator seeded from the base seed and the prompt index) for one sample.

    The seed is ``base * 1_000_003 + prompt_index`` (base: the sampling block's ``seed``, else the suite's), so
    every prompt draws an independent, reproducible stream, whatever ran before it.
    """
    from dtbench.decoders.sampling import SamplingSettings

    base = spec.seed if spec.seed is not None else suite_seed
    generator = torch.Generator(device=device).manual_seed((base * 1_000_003 + prompt_index) % (1 << 63))
    return SamplingSettings(spec.temperature, spec.top_k, spec.top_p), generator


def run_group(group: PromptGroup, prompt, target, draft, device, suite: Suite,
              done: dict[str, tuple[list[int], float]], skip: set[str]) -> Iterator[Outcome]:
    """Measure a prompt group's decoders in order (references first), yielding each outcome as it is measured.

    Args:
        group: the unit of work; prompt: its :class:`~dtbench.harness.data.Prompt`.
        done: (tokens, total seconds) of decoders already stored for this prompt (a resumed run): not re-measured,
            but available as references.
        skip: labels of cells that already failed: not measured.
    """
    outputs = dict(done)
    stop = data.stops_at_eos(suite.stop_at_eos, group.dataset)
    by_label = {cp.label: cp for cp in group.decoders}
    for cp in group.decoders:
        if cp.label in outputs or cp.label in skip:
            continue
        ref = outputs.get(cp.reference_label) if cp.reference_label else None
        ref_plan = by_label.get(cp.reference_label)
        compare = cp.sampling is None and (ref_plan is None or ref_plan.sampling is None)
        outcome = measure_one(cp, prompt, group.gen_length, group.warmup, ref, target, draft, device, suite, compare,
                              stop)
        if outcome.row is not None:
            outputs[cp.label] = (outcome.row["output_tokens"], outcome.row["total_s"], outcome.cpu_s)
        yield outcome


def _group_state(sessions, cells, group: PromptGroup) -> tuple[dict[str, tuple[list[int], float]], set[str]]:
    """(stored outputs by label, failed labels) of one prompt group, from the database."""
    done: dict[str, tuple[list[int], float]] = {}
    failed: set[str] = set()
    with sessions() as session:
        for cp in group.decoders:
            cell = session.get(Cell, cells[(group.dataset.name, group.cap, group.gen_length, cp.label)])
            if cell.status == "failed":
                failed.add(cp.label)
                continue
            sample = session.scalar(select(Sample).where(Sample.cell_id == cell.id,
                                                         Sample.prompt_index == group.prompt_index))
            if sample is not None:
                done[cp.label] = (sample.output_tokens, sample.total_s)
    return done, failed


def _reference_output(sessions, cells, group: PromptGroup, index: int) -> list[int] | None:
    """The stored output tokens of the group's reference decoder (its first decoder without a reference: ``ar``)
    for prompt ``index`` of the same (dataset, L_max, T), or None."""
    ref = next(cp for cp in group.decoders if not cp.reference_label)
    with sessions() as session:
        return session.scalar(select(Sample.output_tokens).where(
            Sample.cell_id == cells[(group.dataset.name, group.cap, group.gen_length, ref.label)],
            Sample.prompt_index == index))


def commit_outcome(sessions, run_id: int, cell_id: int, outcome: Outcome, extra: dict[str, Any] | None = None) -> None:
    """Store one outcome at once (the single writer): the sample, or the cell's failure; refresh the heartbeat."""
    from sqlalchemy.exc import IntegrityError

    with sessions() as session:
        cell = session.get(Cell, cell_id)
        if outcome.row is not None:
            session.add(Sample(cell_id=cell_id, **outcome.row, **(extra or {})))
            if cell.status == "pending":
                cell.status = "running"
        else:
            cell.status, cell.error = "failed", (outcome.error or "")[:2000]
        session.get(Run, run_id).heartbeat_at = utcnow()
        try:
            session.commit()
        except IntegrityError:  # the sample is stored already (a run taken over with --force): keep that one
            session.rollback()
