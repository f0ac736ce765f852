"""Executors: where a run's prompt groups are measured (issue 11), and its cost model calibrated (issue 12).

The driver (:func:`dtbench.harness.runner.run_suite`) owns the run: it plans the suite, tokenizes the prompts, writes
the run and cell rows, refreshes the heartbeat, shows the progress bar and commits every outcome through
:func:`~dtbench.harness.runner.commit_outcome` — one writer, so SQLite works as well as PostgreSQL. An
:class:`Executor` owns the workers: each loads the target and draft once (:class:`Worker`), receives whole prompt
groups (a reference and every decoder that depends on it, in plan order, on one device) and hands back each
:class:`~dtbench.harness.runner.Outcome` as soon as it is measured.

- :class:`LocalExecutor`: one worker inside the driver's process (``--executor local``, the default).
- :class:`~dtbench.harness.ray_executor.RayExecutor`: Ray actors (``--executor ray``): one per GPU (``num_gpus=1``)
  when the device is CUDA, else ``--workers N`` actors of ``--threads-per-worker M`` CPU threads. An actor that dies
  (its process killed, its node lost) has its group retried once on another worker (a replacement is started); a
  group whose worker dies twice fails its not-yet-stored samples' cells with the error. Samples already committed
  are never measured again: the driver reads what is stored (:func:`~dtbench.harness.runner._group_state`) before
  every dispatch.

Calibration (``calibrate: true``, ``n_max: auto``; :func:`dtbench.harness.calibrate.before_cells`) measures where the
cells are measured: the local worker, or the first Ray actor (one calibration per run: a GPU cluster's workers have
the same kind of device; if their device names differ, a one-line warning says whose curves they are). The worker
returns the points as plain data (:class:`~dtbench.harness.calibrate.Measured`); the driver stores them, resolves
``n_max: auto`` in its plan and hands the budgets to every worker (``set_budgets``; a replacement actor gets them
when it starts), so the workers' decoders run the params recorded in the cells.

The interface an executor implements (:class:`Executor`): ``prepare(suite)`` (fail fast: resolve the device),
``start(suite, plan, tokenizer, console) -> WorkerInfo`` (load the models on every worker; the first worker's
environment becomes the run's), ``calibrate(contexts, settings, console) -> Measured`` and ``set_budgets(budgets)``
(above), ``execute(groups, sink)`` (measure every group, calling ``sink.state(group)`` right before handing a group
to a worker and ``sink.commit(group, outcome, worker)`` for each outcome, in the driver's thread), ``close()`` (stop
the workers), and ``describe()`` (recorded in the run's environment).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from rich.console import Console

from dtbench.harness import calibrate, models
from dtbench.harness.chat import TurnNotReady
from dtbench.harness.errors import DtbenchError
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
    if loaded is None:
        return None
    remote = {"trust_remote_code": True} if loaded.trust_remote_code else {}  # the opt-in is recorded with the run
    return {"model": loaded.name, "dtype": loaded.dtype, "params": loaded.params, **remote}


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
        DtbenchError: a model that cannot be loaded or does not fit its tokenizer, or a decoder whose
            ``check_target(params, target)`` refuses the target (a learned head of other sizes).
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
        for p in self.plan.decoders:  # e.g. a learned head that does not fit the target: refused before any timing
            check = getattr(p.cls, "check_target", None)
            if check is not None:
                try:
                    check(p.params, self.target.model)
                except ValueError as exc:
                    raise DtbenchError(f"decoder '{p.label}': {exc}") from None
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

    def calibrate(self, contexts: dict[int, list[int]], settings: calibrate.Settings,
                  console: Console | None = None) -> calibrate.Measured:
        """The cost model's curves measured with this worker's models on its device (plain data for the driver)."""
        return calibrate.measure_on(self, contexts, settings, console)

    def set_budgets(self, budgets: dict[str, int]) -> None:
        """Use the driver's resolved ``n_max: auto`` budgets ({label: n_max}) in this worker's plan."""
        calibrate.apply_budgets(self.plan, budgets)


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

    def calibrate(self, contexts: dict[int, list[int]], settings: calibrate.Settings,
                  console: Console) -> calibrate.Measured:
        """Measure the cost model's curves on a worker (after :meth:`start`, before any group)."""
        raise DtbenchError(f"the {self.name} executor cannot calibrate: calibrate: true and n_max: auto need "
                           f"--executor local or ray (or store a calibration with `dtbench calibrate` first)")

    def set_budgets(self, budgets: dict[str, int]) -> None:
        """Hand the resolved ``n_max: auto`` budgets to every worker, present and future."""

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

    def calibrate(self, contexts, settings, console: Console) -> calibrate.Measured:
        return self.worker.calibrate(contexts, settings, console)

    def set_budgets(self, budgets: dict[str, int]) -> None:
        self.worker.set_budgets(budgets)  # the driver's own plan, resolved already: a no-op kept for symmetry

    def execute(self, groups: Iterable[PromptGroup], sink: Sink) -> None:
        worker = self.worker
        for group in groups:
            done, failed = sink.state(group)
            try:
                prompt = sink.prompt(group)
            except TurnNotReady as exc:  # a later turn whose earlier turn's reference failed: its cells fail
                sink.fail(group, str(exc), worker.info)
                continue
            for outcome in worker.run(group_key(group), prompt, done, failed):
                sink.commit(group, outcome, worker.info)

    def close(self) -> None:
        self.worker = None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "threads": self.threads}


def make_executor(name: str, *, address: str | None = None, workers: int | None = None,
                  threads_per_worker: int | None = None, connect_timeout_s: float | None = None) -> Executor:
    """The executor named by ``dtbench run --executor``.

    Raises:
        DtbenchError: Ray options given to the local executor, or Ray not installed.
    """
    if name == "local":
        if address is not None or (workers is not None and workers != 1):
            raise DtbenchError("--address and --workers need --executor ray (the local executor is one worker)")
        return LocalExecutor(threads=threads_per_worker)
    if name == "ray":
        from dtbench.harness.ray_executor import RayExecutor, import_ray

        import_ray()
        timeout = {} if connect_timeout_s is None else {"connect_timeout_s": connect_timeout_s}
        return RayExecutor(address=address, workers=workers, threads_per_worker=threads_per_worker, **timeout)
    raise DtbenchError(f"unknown executor '{name}' (choose {' or '.join(EXECUTORS)})")


def __getattr__(name: str):  # the Ray executor's names, from their own module (imported on first use)
    if name in ("RayExecutor", "RayWorker", "import_ray", "RAY_MISSING"):
        from dtbench.harness import ray_executor

        return getattr(ray_executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
