"""The measurement loop: expand a suite into cells, drive decoders, time every Step, store every sample.

Cells are dataset x prompt cap x T x decoder. For each (dataset, cap, T) group and each prompt, the reference
decoders (``ar``, and any other decoder's declared reference) run first, then the rest, so every sample is
checked token for token against its reference as soon as it is measured. Each sample is committed at once:
a killed run loses at most the sample in flight, and ``--resume`` continues where it stopped.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dtbench.decoders.base import Decoder, DecoderParams
from dtbench.harness import data, models, registry
from dtbench.harness.db import Cell, Run, Sample, utcnow
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.measure import Measurement, SampleTimeout, cpu_model, device_name, measure  # noqa: F401
from dtbench.harness.metrics import first_divergence, sample_row  # noqa: F401  (re-exported)
from dtbench.harness.suite import DecoderSpec, Suite, suite_hash


@dataclass
class CellPlan:
    """A decoder configuration with its validated params and its reference's label (None for ``ar``)."""

    spec: DecoderSpec
    cls: type[Decoder]
    params: DecoderParams
    distribution: str
    version: str
    reference_label: str | None = None
    implicit: bool = False


@dataclass
class Plan:
    """Everything a run needs, validated before any model is loaded."""

    suite: Suite
    decoders: list[CellPlan]
    skipped: list[str] = field(default_factory=list)  # optional decoders that are not installed

    def decoders_for(self, dataset: str) -> list[CellPlan]:
        return [c for c in self.decoders if c.spec.datasets is None or dataset in c.spec.datasets]


def _params_key(name: str, params: DecoderParams) -> str:
    return name + json.dumps(params.model_dump(mode="json"), sort_keys=True)


def plan_suite(suite: Suite) -> Plan:
    """Validate a suite against the registry and expand it, adding implicit reference decoders.

    Reference decoders come first, in dependency order, so each sample can be compared as it is measured.

    Raises:
        DtbenchError: unknown dataset or decoder, invalid params, a draft-needing decoder without a draft model,
            a label that collides with a reference's; decoder errors name the suite's file, line and entry.
    """
    for ds in suite.datasets:
        data.check_dataset(ds)
    found = registry.scan()
    entries = registry.discover()
    plans: list[CellPlan] = []
    skipped: list[str] = []
    for spec in suite.expanded_decoders():
        where = f"{spec.where}: " if spec.where else ""
        if spec.optional and spec.name not in entries and spec.name not in found.ambiguous:
            skipped.append(spec.display)
            continue
        try:
            cls = registry.get(spec.name)
            params = registry.validate_params(spec.name, spec.params)
        except DtbenchError as exc:
            raise DtbenchError(f"{where}{exc}") from None
        if cls.needs_draft and suite.draft is None:
            raise DtbenchError(f"{where}decoder '{spec.display}' needs a draft model: add `draft:` to the suite")
        e = entries[spec.name]
        plans.append(CellPlan(spec, cls, params, e.distribution, f"{cls.version} ({e.distribution} {e.version})"))
    by_key = {_params_key(p.spec.name, p.params): p for p in plans}
    queue = list(plans)
    while queue:
        p = queue.pop(0)
        ref = _reference_of(p)
        if ref is None:
            continue
        name, raw = ref
        rparams = registry.validate_params(name, raw)
        key = _params_key(name, rparams)
        if key not in by_key:
            rcls = registry.get(name)
            label = name if not raw else f"{name} ({', '.join(f'{k}={v}' for k, v in raw.items())})"
            e = entries[name]
            rp = CellPlan(DecoderSpec(name=name, label=label, params=raw), rcls, rparams, e.distribution,
                          f"{rcls.version} ({e.distribution} {e.version})", implicit=True)
            clash = next((q for q in plans if q.spec.display == label), None)
            if clash is not None:
                where = f"{clash.spec.where}: " if clash.spec.where else ""
                raise DtbenchError(f"{where}label '{clip(label, 80)}' of decoder '{clash.spec.name}' is the label of "
                                   f"the reference decoder '{name}' that dtbench adds; choose another label")
            by_key[key] = rp
            plans.append(rp)
            queue.append(rp)
        p.reference_label = by_key[key].spec.display
    return Plan(suite=suite, decoders=_reference_order(plans), skipped=skipped)


def preflight(suite: Suite, plan: Plan, console: Console) -> None:
    """Checks that read files but no model weights, shared by ``validate`` and ``run``: a ``text-files`` corpus is
    text; L_max + T fits each model's context (a warning past a rotary model's trained context).

    Raises:
        DtbenchError: a non-text document, or L_max + T beyond a model's learned position table.
    """
    for ds in suite.datasets:
        data.check_dataset(ds, files=True)
    longest = max(cap for ds in suite.datasets for cap in ds.caps) + max(suite.generation_lengths)
    specs = [suite.target]
    if suite.draft is not None and any(p.cls.needs_draft for p in plan.decoders):
        specs.append(suite.draft)
    for spec in specs:
        warning = models.check_context(spec, longest)
        if warning:
            console.print(f"[yellow]warning: {warning}[/yellow]")


def _reference_of(p: CellPlan) -> tuple[str, dict] | None:
    """The decoder's declared reference, computed without models (reference() reads params only)."""
    probe = p.cls.__new__(p.cls)
    probe.params, probe.target, probe.draft = p.params, None, None
    return probe.reference()


def _reference_order(plans: list[CellPlan]) -> list[CellPlan]:
    by_label = {p.spec.display: p for p in plans}
    ordered: list[CellPlan] = []
    seen: set[str] = set()

    def visit(p: CellPlan, stack: tuple[str, ...] = ()) -> None:
        if p.spec.display in seen:
            return
        if p.spec.display in stack:
            raise DtbenchError(f"decoder references form a cycle: {' -> '.join(stack)}")
        if p.reference_label:
            visit(by_label[p.reference_label], stack + (p.spec.display,))
        seen.add(p.spec.display)
        ordered.append(p)

    referenced = {p.reference_label for p in plans if p.reference_label}
    for p in [p for p in plans if p.spec.display in referenced] + plans:
        visit(p)
    return ordered


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and hardware of this run, stored with it so results stay interpretable."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "dtbench": version("dtbench"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "git_sha": _git_sha(),
    }
    return env


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


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
) -> int:
    """Run a suite and store every sample; return the run id.

    A decoder that raises, exits, yields bad Steps or runs past the per-sample time limit fails its cell (with
    the error) and the run goes on. The run's recorded status is always true: ``completed`` only when every cell
    was attempted; ``interrupted`` on Ctrl-C/SIGTERM; ``failed`` (with the error) when the runner itself failed.
    Both of the latter can be continued with ``resume``.

    Args:
        suite, suite_text: the validated suite and its YAML text (stored with the run).
        sessions: a session factory from ``db.connect``.
        data_dir: local dataset folder (else the suite's, ``DTBENCH_DATA_DIR`` or the hub).
        resume: id of an unfinished run of the same suite to continue (completed samples are skipped).
        force: resume even if the run's owner process still looks alive.
        console: where progress goes (stderr by default).

    Raises:
        DtbenchError: bad suite/models/data (before the run row is written); RunInterrupted on Ctrl-C/SIGTERM;
            RunFailed when the runner itself failed mid-run.
    """
    console = console or Console(stderr=True)
    plan = plan_suite(suite)
    for label in plan.skipped:
        console.print(f"[yellow]note: optional decoder '{label}' is not installed; skipped[/yellow]")
    for line in registry.scan().warnings("decoder"):
        console.print(f"[yellow]warning: {line}[/yellow]")
    preflight(suite, plan, console)
    device = models.resolve_device(suite.device)

    # Everything cheap and fallible first: tokenizers, vocabulary, prompts. Then the models.
    tokenizer = models.load_tokenizer(suite.target)
    if suite.draft is not None and suite.draft.model != suite.target.model:
        models.check_tokenizers(tokenizer, models.load_tokenizer(suite.draft), suite.target.model, suite.draft.model)
    prompts: dict[tuple[str, int], list[data.Prompt]] = {}
    for ds in suite.datasets:
        docs = data.load_documents(ds, data_dir)
        for cap in ds.caps:
            prompts[(ds.name, cap)] = data.select_prompts(docs, tokenizer, ds.prompts, cap, suite.seed)
    with console.status(f"loading target {suite.target.model} ({suite.target.dtype}) on {device}"):
        target = models.load_model(suite.target, device)
    models.check_embedding(target.model, tokenizer, suite.target.model)
    draft = None
    if suite.draft is not None and any(p.cls.needs_draft for p in plan.decoders):
        with console.status(f"loading draft {suite.draft.model} ({suite.draft.dtype})"):
            draft = models.load_model(suite.draft, device)
        models.check_embedding(draft.model, tokenizer, suite.draft.model)

    with sessions() as session:
        run = _open_run(session, suite, suite_text, suite_path, resume, force, device, target, draft)
        run_id = run.id
        cells = _open_cells(session, run, plan, target, draft)
        session.commit()

    groups = [(ds, cap, T) for ds in suite.datasets for cap in ds.caps for T in suite.generation_lengths]
    total = sum(len(plan.decoders_for(ds.name)) * ds.prompts for ds, cap, T in groups)
    status, error = "failed", None
    heartbeat = _Heartbeat(sessions, run_id)
    try:
        with _sigterm_as_interrupt(), heartbeat, Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=console, disable=not progress, transient=False,
        ) as bar:
            task = bar.add_task("starting", total=total)
            for ds, cap, T in groups:
                decs = plan.decoders_for(ds.name)
                for prompt in prompts[(ds.name, cap)]:
                    outputs: dict[str, tuple[list[int], float]] = {}
                    for cp in decs:
                        bar.update(task, description=f"{ds.name} L_max={cap} T={T} · {cp.spec.display} · "
                                                     f"prompt {prompt.index + 1}/{ds.prompts}")
                        _run_one(sessions, run_id, cells[(ds.name, cap, T, cp.spec.display)], cp, prompt, T,
                                 prompt.index < ds.warmup, outputs, target, draft, device, suite)
                        bar.advance(task)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
    except BaseException as exc:
        error = clip(f"{type(exc).__name__}: {exc}", 2000)
        raise RunFailed(f"run {run_id} failed: {clip(error, 300)}; measured samples are kept "
                        f"(continue with --resume-run {run_id})") from exc
    finally:
        _close_run(sessions, run_id, status, error, console)
    if status == "interrupted":
        raise RunInterrupted(f"run {run_id} interrupted; measured samples are kept (continue with --resume-run {run_id})")
    return run_id


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


def _open_run(session, suite, suite_text, suite_path, resume, force, device, target, draft) -> Run:
    env = environment(device)
    env["target"] = {"model": target.name, "dtype": target.dtype, "params": target.params}
    env["draft"] = {"model": draft.name, "dtype": draft.dtype, "params": draft.params} if draft else None
    owner = dict(owner_host=socket.gethostname(), owner_pid=os.getpid(), heartbeat_at=utcnow())
    if resume is None:
        run = Run(suite_name=suite.name, suite_path=suite_path, suite_text=suite_text, suite_hash=suite_hash(suite_text),
                  status="running", environment=env, **owner)
        session.add(run)
        session.flush()
        return run
    run = session.get(Run, resume)
    if run is None:
        raise DtbenchError(f"no run {resume} to resume")
    if run.status == "completed":
        raise DtbenchError(f"run {resume} is completed; nothing to resume")
    if run.suite_hash != suite_hash(suite_text):
        raise DtbenchError(f"run {resume} was made from a different suite text ({run.suite_name}); cannot resume it with this one")
    alive = owner_alive(run)
    if alive and not force:
        raise DtbenchError(f"run {resume} is still being written: {alive}; wait for it, or take it over with --force")
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


def _open_cells(session, run, plan, target, draft) -> dict[tuple[str, int, int, str], int]:
    existing = {(c.dataset, c.prompt_cap, c.gen_length, c.label): c for c in run.cells}
    ids = {}
    for ds in plan.suite.datasets:
        for cap in ds.caps:
            for T in plan.suite.generation_lengths:
                for cp in plan.decoders_for(ds.name):
                    key = (ds.name, cap, T, cp.spec.display)
                    cell = existing.get(key)
                    if cell is None:
                        cell = Cell(
                            run=run, dataset=ds.name, prompt_cap=cap, gen_length=T, decoder=cp.spec.name,
                            label=cp.spec.display, decoder_version=str(cp.version), decoder_distribution=cp.distribution,
                            params=cp.params.model_dump(mode="json"), lossless_expected=cp.cls.lossless,
                            reference_label=cp.reference_label,
                            target_model=f"{target.name} ({target.dtype})",
                            draft_model=f"{draft.name} ({draft.dtype})" if (draft and cp.cls.needs_draft) else None,
                        )
                        session.add(cell)
                    elif cell.status == "failed":
                        cell.status, cell.error = "pending", None  # a resumed run retries failed cells
                    session.flush()
                    ids[key] = cell.id
    return ids


def _run_one(sessions, run_id, cell_id, cp: CellPlan, prompt, T, warmup, outputs, target, draft, device,
             suite: Suite) -> None:
    """Measure one (cell, prompt) unless already stored or the cell failed; commit the sample at once.

    Anything the decoder does wrong — raising, calling ``sys.exit``, yielding Steps that cannot become a sample,
    running past the time limit — fails the cell with the error; only Ctrl-C and the runner's own failures
    (the database) propagate.
    """
    label = cp.spec.display
    with sessions() as session:
        cell = session.get(Cell, cell_id)
        if cell.status == "failed":
            return
        done = session.scalar(select(Sample).where(Sample.cell_id == cell_id, Sample.prompt_index == prompt.index))
        if done is not None:
            outputs[label] = (done.output_tokens, done.total_s)
            return
        cell.status = "running"
        session.commit()
    ref = outputs.get(cp.reference_label) if cp.reference_label else None
    if cp.reference_label and ref is None:
        _fail(sessions, cell_id, f"reference decoder '{cp.reference_label}' has no output for prompt {prompt.index}")
        return
    timeout = sample_timeout(suite.timeout_s, ref[1] if ref else None)
    try:
        torch.manual_seed(suite.seed)
        decoder = cp.cls(target.model, draft.model if (draft and cp.cls.needs_draft) else None, cp.params)
        m = measure(decoder, prompt.token_ids, T, device, timeout_s=timeout)
        row = sample_row(m, prompt, warmup, ref[0] if ref else None)
        json.dumps(row)  # the JSON columns must serialize: a bad Step is the decoder's failure, not the run's
    except KeyboardInterrupt:
        raise
    except SampleTimeout:
        _fail(sessions, cell_id, f"prompt {prompt.index}: timed out after {timeout:g} s")
        return
    except (Exception, SystemExit) as exc:  # a decoder failing mid-run fails its cell, never the run
        kind = "SystemExit (the decoder called sys.exit)" if isinstance(exc, SystemExit) else type(exc).__name__
        _fail(sessions, cell_id, f"prompt {prompt.index}: {kind}: {clip(exc, 1500)}")
        return
    outputs[label] = (m.tokens, row["total_s"])
    with sessions() as session:
        session.add(Sample(cell_id=cell_id, **row))
        session.get(Run, run_id).heartbeat_at = utcnow()
        session.commit()


def _fail(sessions, cell_id: int, message: str) -> None:
    with sessions() as session:
        cell = session.get(Cell, cell_id)
        cell.status, cell.error = "failed", message[:2000]
        session.commit()
