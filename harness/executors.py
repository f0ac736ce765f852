"""Executors: where a run's prompt groups are measured (issue 11).

The driver (:func:`dtbench.harness.runner.run_suite`) owns the run: it plans the suite, tokenizes the prompts, writes
the run and cell rows, refreshes the heartbeat, shows the progress bar and commits every outcome through
:func:`~dtbench.harness.runner.commit_outcome` — one writer, so SQLite works as well as PostgreSQL. An
:class:`Executor` owns the workers: each loads the target and draft once (:class:`Worker`), receives whole prompt
groups (a reference and every decoder that depends on it, in plan order, on one device) and hands back each
:class:`~dtbench.harness.runner.Outcome` as soon as it is measured.

- :class:`LocalExecutor`: one worker inside the driver's process (``--executor local``, the default).
- :class:`RayExecutor`: Ray actors (``--executor ray``): one per GPU (``num_gpus=1``) when the device is CUDA, else
  ``--workers N`` actors of ``--threads-per-worker M`` CPU threads. An actor that dies (its process killed, its node
  lost) has its group retried once on another worker (a replacement is started); a group whose worker dies twice
  fails its not-yet-stored samples' cells with the error. Samples already committed are never measured again: the
  driver reads what is stored (:func:`~dtbench.harness.runner._group_state`) before every dispatch.

The interface an executor implements (:class:`Executor`): ``prepare(suite)`` (fail fast: resolve the device),
``start(suite, plan, tokenizer, console) -> WorkerInfo`` (load the models on every worker; the first worker's
environment becomes the run's), ``execute(groups, sink)`` (measure every group, calling ``sink.state(group)`` right
before handing a group to a worker and ``sink.commit(group, outcome, worker)`` for each outcome, in the driver's
thread), ``close()`` (stop the workers), and ``describe()`` (recorded in the run's environment).
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from rich.console import Console

from dtbench.harness import models
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.measure import device_name, environment
from dtbench.harness.plan import Plan, PromptGroup, plan_suite
from dtbench.harness.runner import Outcome, run_group
from dtbench.harness.suite import Suite

EXECUTORS = ("local", "ray")

GroupKey = tuple[str, int, int, int]  # (dataset, L_max, T, prompt index)


def group_key(group: PromptGroup) -> GroupKey:
    return (group.dataset.name, group.cap, group.gen_length, group.prompt_index)


@dataclass
class WorkerInfo:
    """Who measures: a worker's host, process, device and the models it loaded (plain data, sent between processes).

    ``environment`` is :func:`~dtbench.harness.measure.environment` of the worker's device plus ``target``/``draft``
    descriptions: the first worker's becomes the run's (``runs.environment``). ``decoders`` lists the (label,
    version) of the worker's own plan, which must equal the driver's.
    """

    host: str
    pid: int
    device: str
    device_name: str
    environment: dict[str, Any]
    target: dict[str, Any]
    draft: dict[str, Any] | None
    decoders: list[tuple[str, str]]
    warnings: list[str] = field(default_factory=list)

    @property
    def extra(self) -> dict[str, str]:
        """The ``samples`` columns saying where a sample was measured."""
        return {"worker_host": self.host[:255], "device_name": self.device_name[:200]}

    @property
    def where(self) -> str:
        return f"{self.host} (pid {self.pid}, {self.device_name})"


def _model_info(loaded: models.LoadedModel | None) -> dict[str, Any] | None:
    return None if loaded is None else {"model": loaded.name, "dtype": loaded.dtype, "params": loaded.params}


class Worker:
    """Loads the target and draft once and measures prompt groups with them: in the driver's process
    (:class:`LocalExecutor`) or inside a Ray actor (:class:`RayExecutor`).

    Args:
        suite: the validated suite; device: ``cpu``/``cuda``/``auto`` as the worker resolves it.
        plan: the driver's plan (local); a Ray worker plans the suite itself with its own decoder registry.
        tokenizer: the target's tokenizer, if already loaded (checked against the models' embeddings).
        threads: ``torch.set_num_threads`` for this worker (None: leave it).
        cwd: a folder to change to first, so relative model paths mean what they mean to the driver.
        status: a context-manager factory showing what is loading (the driver's spinner), or None.

    Raises:
        DtbenchError: a model that cannot be loaded or does not fit its tokenizer.
    """

    def __init__(self, suite: Suite, device: str, *, plan: Plan | None = None, tokenizer=None,
                 threads: int | None = None, cwd: str | None = None,
                 status: Callable[[str], Any] | None = None):
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        if threads:
            torch.set_num_threads(threads)
        status = status or (lambda _text: nullcontext())
        self.suite = suite
        self.plan = plan if plan is not None else plan_suite(suite)
        self.device = models.resolve_device(device)
        if tokenizer is None:
            tokenizer = models.load_tokenizer(suite.target)
        with status(f"loading target {suite.target.model} ({suite.target.dtype}) on {self.device}"):
            self.target = models.load_model(suite.target, self.device)
        loaded = [(self.target, suite.target)]
        self.draft = None
        if suite.draft is not None and any(p.cls.needs_draft for p in self.plan.decoders):
            with status(f"loading draft {suite.draft.model} ({suite.draft.dtype})"):
                self.draft = models.load_model(suite.draft, self.device)
            loaded.append((self.draft, suite.draft))
        warnings = []
        longest = max(cap for ds in suite.datasets for cap in ds.caps) + max(suite.generation_lengths)
        for model, spec in loaded:  # hub models' configs are known only now
            models.check_embedding(model.model, tokenizer, spec.model)
            if not models.check_context(spec, longest):  # not warned at preflight already
                warning = models.context_problem(model.model.config, spec.model, longest)
                if warning:
                    warnings.append(warning)
        self.groups = {group_key(g): g for g in self.plan.groups()}
        env = environment(self.device)
        env["target"], env["draft"] = _model_info(self.target), _model_info(self.draft)
        self.info = WorkerInfo(
            host=socket.gethostname(), pid=os.getpid(), device=str(self.device), device_name=device_name(self.device),
            environment=env, target=_model_info(self.target), draft=_model_info(self.draft),
            decoders=[(p.label, p.version) for p in self.plan.decoders], warnings=warnings,
        )

    def run(self, key: GroupKey, prompt, done: dict[str, tuple[list[int], float]], skip: set[str]) -> Iterator[Outcome]:
        """Measure one prompt group (see :func:`~dtbench.harness.runner.run_group`), yielding each outcome."""
        group = self.groups.get(key)
        if group is None:
            raise DtbenchError(f"this worker's plan has no prompt group {key}")
        yield from run_group(group, prompt, self.target, self.draft, self.device, self.suite, done, skip)


class Sink(Protocol):
    """What the driver offers an executor (implemented by the runner)."""

    def prompt(self, group: PromptGroup): ...

    def state(self, group: PromptGroup) -> tuple[dict[str, tuple[list[int], float]], set[str]]:
        """(stored outputs by label, labels whose cells failed) of a group, read right before it is dispatched."""

    def commit(self, group: PromptGroup, outcome: Outcome, worker: WorkerInfo) -> None:
        """Store one outcome (the single writer) and advance the progress bar."""

    def fail(self, group: PromptGroup, error: str, worker: WorkerInfo | None) -> None:
        """Fail the cells of the group's samples not stored yet, with ``error``."""

    def note(self, text: str) -> None:
        """A line for the user (stderr)."""


class Executor:
    """Hands a plan's prompt groups to workers; see the module docstring for the protocol."""

    name = "executor"

    def prepare(self, suite: Suite) -> None:
        """Cheap checks before anything is loaded (the device exists; Ray is installed and reachable)."""

    def start(self, suite: Suite, plan: Plan, tokenizer, console: Console) -> WorkerInfo:
        """Load the models on every worker; the returned worker's environment becomes the run's."""
        raise NotImplementedError

    def execute(self, groups: Iterable[PromptGroup], sink: Sink) -> None:
        """Measure every group (references before dependents within each), committing through ``sink``."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the workers (also after Ctrl-C or a failure); never raises."""

    def describe(self) -> dict[str, Any]:
        """How the run was executed, for ``runs.environment["executor"]``."""
        return {"name": self.name}


class LocalExecutor(Executor):
    """One worker in the driver's process: every group in plan order (dtbench's behaviour before executors).

    Args:
        threads: torch threads of this process (None: torch's default).
    """

    name = "local"

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self.worker: Worker | None = None

    def prepare(self, suite: Suite) -> None:
        self.device = models.resolve_device(suite.device)

    def start(self, suite: Suite, plan: Plan, tokenizer, console: Console) -> WorkerInfo:
        self.worker = Worker(suite, str(self.device), plan=plan, tokenizer=tokenizer, threads=self.threads,
                             status=console.status)
        return self.worker.info

    def execute(self, groups: Iterable[PromptGroup], sink: Sink) -> None:
        worker = self.worker
        for group in groups:
            done, failed = sink.state(group)
            for outcome in worker.run(group_key(group), sink.prompt(group), done, failed):
                sink.commit(group, outcome, worker.info)

    def close(self) -> None:
        self.worker = None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "threads": self.threads}


# --- Ray ---------------------------------------------------------------------------------------------------------


RAY_MISSING = "--executor ray needs Ray, which is not installed: pip install 'dtbench[ray]'"
MAX_ATTEMPTS = 2  # a group whose worker dies is retried once, then its remaining samples fail their cells


def import_ray():
    """The ``ray`` module.

    Raises:
        DtbenchError: one line saying how to install it.
    """
    try:
        import ray
    except ImportError:
        raise DtbenchError(RAY_MISSING) from None
    return ray


class RayWorker:
    """The body of a Ray actor: a :class:`Worker` built in the actor's process. Never raises from ``__init__``
    (the error comes back from :meth:`ready`, as one line), so a bad model is a user error, not a dead actor."""

    def __init__(self, suite: Suite, device: str, threads: int | None, cwd: str | None):
        self.worker, self.error = None, None
        try:
            self.worker = Worker(suite, device, threads=threads, cwd=cwd)
        except DtbenchError as exc:
            self.error = str(exc)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {clip(exc, 1000)}"

    def ready(self) -> WorkerInfo | str:
        """The worker's :class:`WorkerInfo`, or the one-line error that kept it from loading its models."""
        if self.worker is None:
            return f"worker on {socket.gethostname()} (pid {os.getpid()}): {self.error}"
        return self.worker.info

    def run(self, key: GroupKey, prompt, done, skip) -> Iterator[Outcome]:
        """A streaming generator: each outcome travels to the driver as soon as it is measured."""
        yield from self.worker.run(key, prompt, done, skip)


@dataclass
class _Actor:
    handle: Any
    ready_ref: Any
    info: WorkerInfo | None = None


class RayExecutor(Executor):
    """Prompt groups on Ray actors, each keeping its loaded target and draft; the driver commits every outcome.

    Args:
        address: a Ray cluster to join (``auto``, ``HOST:PORT``, ``ray://...``); None: ``$RAY_ADDRESS``, else a
            local Ray instance started for this run (and shut down after it).
        workers: number of actors; default one per GPU on CUDA, else the cluster's CPUs // ``threads_per_worker``.
        threads_per_worker: CPUs reserved by each actor (``num_cpus``) and its ``torch.set_num_threads``.
    """

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None, threads_per_worker: int | None = None):
        self.address, self.n_workers, self.threads = address, workers, threads_per_worker or 1
        self.ray = None
        self._remote = None
        self.started_ray = False
        self.actors: list[_Actor] = []
        self.device = "cpu"
        self.restarts_left = 0

    def prepare(self, suite: Suite) -> None:
        ray = self.ray = import_ray()
        if not ray.is_initialized():
            import logging

            kwargs: dict[str, Any] = dict(logging_level=logging.ERROR, log_to_driver=True)
            if self.address is None and not os.environ.get("RAY_ADDRESS"):
                kwargs["include_dashboard"] = False  # a local instance of our own: nothing to look at
            try:
                ray.init(address=self.address, **kwargs)
            except Exception as exc:
                raise DtbenchError(f"cannot start or join Ray (address {self.address or 'local'}): "
                                   f"{type(exc).__name__}: {clip(exc, 300)}") from None
            self.started_ray = True
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        if suite.device == "cuda" and gpus == 0:
            raise DtbenchError("the suite asks for device: cuda, and the Ray cluster has no GPU")
        self.device = "cuda" if suite.device in ("cuda", "auto") and gpus > 0 else "cpu"
        if self.device == "cuda":
            n = self.n_workers or gpus
            if n > gpus:
                raise DtbenchError(f"--workers {n}: the Ray cluster has {gpus} GPU(s), one per worker")
        else:
            n = self.n_workers or max(1, cpus // self.threads)
            if n * self.threads > cpus:
                raise DtbenchError(f"--workers {n} x --threads-per-worker {self.threads} needs {n * self.threads} CPUs; "
                                   f"the Ray cluster has {cpus}")
        self.n_workers = n
        self.restarts_left = 2 * n + 2

    def _spawn(self, suite: Suite) -> _Actor:
        if self._remote is None:
            self._remote = self.ray.remote(RayWorker).options(
                num_cpus=self.threads, num_gpus=1 if self.device == "cuda" else 0, max_restarts=0, max_concurrency=1)
        handle = self._remote.remote(suite, self.device, self.threads, os.getcwd())
        return _Actor(handle, handle.ready.remote())

    def start(self, suite: Suite, plan: Plan, tokenizer, console: Console) -> WorkerInfo:
        ray = self.ray
        self.suite, self.plan = suite, plan
        self.actors = [self._spawn(suite) for _ in range(self.n_workers)]
        expected = [(p.label, p.version) for p in plan.decoders]
        pending = {a.ready_ref: a for a in self.actors}
        with console.status(f"starting {self.n_workers} Ray worker(s) on {self.device}: loading "
                            f"{suite.target.model} and the draft on each") as spinner:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    actor = pending.pop(ref)
                    actor.info = self._ready(ref)
                    if actor.info.decoders != expected:
                        raise DtbenchError(f"Ray worker {actor.info.where} has other decoders or versions than this "
                                           f"driver: {_diff(actor.info.decoders, expected)}; install the same dtbench "
                                           f"and plugins on every node")
                spinner.update(f"starting {self.n_workers} Ray worker(s) on {self.device}: "
                               f"{self.n_workers - len(pending)} ready")
        infos = [a.info for a in self.actors]
        names = sorted({i.device_name for i in infos})
        if len(names) > 1:
            console.print(f"[yellow]warning: the Ray workers have different devices ({'; '.join(names)}); a cell "
                          f"measured on several is flagged in the report[/yellow]")
        infos[0].warnings = sorted({w for i in infos for w in i.warnings})
        return infos[0]

    def _ready(self, ref) -> WorkerInfo:
        from ray.exceptions import RayActorError

        try:
            info = self.ray.get(ref)
        except RayActorError as exc:
            raise DtbenchError(f"a Ray worker died while loading the models: {_one_line(exc)}") from None
        if isinstance(info, str):
            raise DtbenchError(info)
        return info

    def execute(self, groups: Iterable[PromptGroup], sink: Sink) -> None:
        ray = self.ray
        from ray.exceptions import ObjectLostError, RayActorError

        queue: deque[PromptGroup] = deque(groups)
        attempts: dict[GroupKey, int] = {}
        idle: deque[_Actor] = deque(self.actors)
        starting: dict[Any, _Actor] = {}
        running: dict[Any, tuple[_Actor, PromptGroup]] = {}
        while queue or running:
            while idle and queue:
                group = queue.popleft()
                done, skip = sink.state(group)
                if all(cp.label in done or cp.label in skip for cp in group.decoders):
                    continue
                actor = idle.popleft()
                gen = actor.handle.run.options(num_returns="streaming").remote(
                    group_key(group), sink.prompt(group), done, skip)
                running[gen] = (actor, group)
            if not running and queue and not idle and not starting:
                raise DtbenchError("every Ray worker died and none could be restarted; measured samples are kept")
            if not running and not starting:
                continue  # every remaining group was already stored
            ready, _ = ray.wait([*running, *starting], num_returns=1, timeout=1.0)
            for ref in ready:
                if ref in starting:  # a replacement worker finished loading
                    actor = starting.pop(ref)
                    try:
                        actor.info = self._ready(ref)
                    except DtbenchError as exc:
                        sink.note(f"a replacement Ray worker could not start: {exc}")
                        self._kill(actor)
                        continue
                    idle.append(actor)
                    continue
                actor, group = running[ref]
                try:
                    out_ref = next(ref)
                except StopIteration:  # the group is measured
                    del running[ref]
                    idle.append(actor)
                    continue
                try:
                    outcome = ray.get(out_ref)
                except (RayActorError, ObjectLostError) as exc:
                    del running[ref]
                    self._lost(actor, group, exc, queue, attempts, starting, sink)
                    continue
                sink.commit(group, outcome, actor.info)

    def _lost(self, actor: _Actor, group: PromptGroup, exc: Exception, queue, attempts, starting, sink) -> None:
        """A worker died mid-group: retry the group once (first in the queue), else fail its remaining samples;
        start a replacement worker while the restart budget lasts."""
        self._kill(actor)
        key = group_key(group)
        attempts[key] = attempts.get(key, 0) + 1
        what = (f"Ray worker {actor.info.where} died while measuring {group.dataset.name} L_max={group.cap} "
                f"T={group.gen_length} prompt {group.prompt_index}: {_one_line(exc)}")
        if attempts[key] < MAX_ATTEMPTS:
            sink.note(f"{what}; retrying the group on another worker")
            queue.appendleft(group)
        else:
            sink.note(f"{what}; it was the group's second attempt, so its remaining samples fail their cells")
            sink.fail(group, f"prompt {group.prompt_index}: the worker died (twice): {_one_line(exc, 300)}",
                      actor.info)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            new = self._spawn(self.suite)
            self.actors.append(new)
            starting[new.ready_ref] = new

    def _kill(self, actor: _Actor) -> None:
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass
        if actor in self.actors:
            self.actors.remove(actor)

    def close(self) -> None:
        if self.ray is None:
            return
        for actor in list(self.actors):
            self._kill(actor)
        if self.started_ray:
            try:
                self.ray.shutdown()
            except Exception:
                pass
            self.started_ray = False

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "workers": self.n_workers,
                "threads_per_worker": self.threads, "device": self.device}


def _one_line(exc: BaseException, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return clip(f"{type(exc).__name__}: {lines[0] if lines else ''}", limit)


def _diff(got: list[tuple[str, str]], expected: list[tuple[str, str]]) -> str:
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    parts = [f"it has {', '.join(f'{l} {v}' for l, v in extra)}" if extra else "",
             f"it lacks {', '.join(f'{l} {v}' for l, v in missing)}" if missing else ""]
    return clip("; ".join(p for p in parts if p) or "the same decoders in another order", 300)


def make_executor(name: str, *, address: str | None = None, workers: int | None = None,
                  threads_per_worker: int | None = None) -> Executor:
    """The executor named by ``dtbench run --executor``.

    Raises:
        DtbenchError: Ray options given to the local executor, or Ray not installed.
    """
    if name == "local":
        if address is not None or (workers is not None and workers != 1):
            raise DtbenchError("--address and --workers need --executor ray (the local executor is one worker)")
        return LocalExecutor(threads=threads_per_worker)
    if name == "ray":
        import_ray()
        return RayExecutor(address=address, workers=workers, threads_per_worker=threads_per_worker)
    raise DtbenchError(f"unknown executor '{name}' (choose {' or '.join(EXECUTORS)})")
