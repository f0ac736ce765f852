"""Executors: where a run's prompt groups are measured (issue 11), and its cost model calibrated (issue 12).

The driver (:func:`dtbench.harness.execution.runner.run_suite`) owns the run: it plans the suite, tokenizes the prompts, writes
the run and cell rows, refreshes the heartbeat (:mod:`dtbench.harness.store.runs`), shows the progress bar and commits
every outcome through :func:`~dtbench.harness.execution.runner.commit_outcome` — one writer, so SQLite works as well as
PostgreSQL. An :class:`Executor` owns the workers: each loads the target and draft once
(:class:`~dtbench.harness.execution.worker.Worker`), receives whole prompt groups (a reference and every decoder that depends on
it, in plan order, on one device) and hands back each :class:`~dtbench.harness.measurement.cells.Outcome` as soon as it is
measured.

- :class:`LocalExecutor`: one worker inside the driver's process (``--executor local``, the default).
- :class:`~dtbench.harness.execution.ray_executor.RayExecutor`: Ray actors (``--executor ray``): one per GPU (``num_gpus=1``)
  when the device is CUDA, else ``--workers N`` actors of ``--threads-per-worker M`` CPU threads. An actor that dies
  (its process killed, its node lost) has its group retried once on another worker (a replacement is started); a
  group whose worker dies twice fails its not-yet-stored samples' cells with the error. Samples already committed
  are never measured again: the driver reads what is stored (``Sink.state``) before every dispatch.

Calibration (``calibrate: true``, ``n_max: auto``; :func:`dtbench.harness.calibration.calibrate_run.before_cells`) measures where the
cells are measured: the local worker, or the first Ray actor (one calibration per run: a GPU cluster's workers have
the same kind of device; if their device names differ, a one-line warning says whose curves they are). The worker
returns the points as plain data (:class:`~dtbench.harness.calibration.calibrate.Measured`); the driver stores them, resolves
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

from collections.abc import Iterable
from typing import Any, Protocol

from rich.console import Console

from dtbench.harness.calibration import calibrate
from dtbench.harness.data.chat import PromptFailed, TurnNotReady
from dtbench.harness.errors import DtbenchError
from dtbench.harness.execution.worker import Worker, WorkerInfo
from dtbench.harness.measurement.cells import Outcome
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.models import loading as models
from dtbench.harness.suites.plan import Plan, PromptGroup
from dtbench.harness.suites.suite import Suite
from dtbench.registry import Registry, subclass_of


class Sink(Protocol):
    """What the driver offers an executor (implemented by the runner)."""

    def prompt(self, group: PromptGroup): ...

    def state(self, group: PromptGroup) -> tuple[dict[str, Reference], set[str]]:
        """(stored outputs by label, labels whose cells failed) of a group, read right before it is dispatched."""

    def commit(self, group: PromptGroup, outcome: Outcome, worker: WorkerInfo) -> None:
        """Store one outcome (the single writer) and advance the progress bar."""

    def fail(self, group: PromptGroup, error: str, worker: WorkerInfo | None) -> None:
        """Fail the cells of the group's samples not stored yet, with ``error``."""

    def note(self, text: str) -> None:
        """A line for the user (stderr)."""

    def started(self, group: PromptGroup, label: str) -> None:
        """Decoder ``label`` starts on ``group`` now (recorded, so a run whose process dies names its cell)."""


class Executor:
    """Hands a plan's prompt groups to workers; see the module docstring for the protocol."""

    name = "executor"

    @classmethod
    def from_options(
        cls,
        *,
        address: str | None = None,
        workers: int | None = None,
        threads_per_worker: int | None = None,
        connect_timeout_s: float | None = None,
    ) -> Executor:
        """The executor ``dtbench run --executor NAME`` builds from its options (default: no options accepted).

        Raises:
            DtbenchError: an option this executor does not take.
        """
        given = [o for o, v in (("--address", address), ("--workers", workers)) if v is not None]
        if given:
            raise DtbenchError(f"{' and '.join(given)} are not options of the {cls.name} executor")
        return cls()

    def prepare(self, suite: Suite) -> None:
        """Cheap checks before anything is loaded (the device exists; Ray is installed and reachable)."""

    def start(self, suite: Suite, plan: Plan, tokenizer, console: Console) -> WorkerInfo:
        """Load the models on every worker; the returned worker's environment becomes the run's."""
        raise NotImplementedError

    def calibrate(
        self, contexts: dict[int, list[int]], settings: calibrate.Settings, console: Console
    ) -> calibrate.Measured:
        """Measure the cost model's curves on a worker (after :meth:`start`, before any group)."""
        raise DtbenchError(
            f"the {self.name} executor cannot calibrate: calibrate: true and n_max: auto need "
            f"--executor local or ray (or store a calibration with `dtbench calibrate` first)"
        )

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

    @classmethod
    def from_options(
        cls,
        *,
        address: str | None = None,
        workers: int | None = None,
        threads_per_worker: int | None = None,
        connect_timeout_s: float | None = None,
    ) -> Executor:
        """One worker in this process, with ``threads_per_worker`` torch threads.

        Raises:
            DtbenchError: ``--address`` or ``--workers`` other than 1 (Ray's options).
        """
        if address is not None or (workers is not None and workers != 1):
            raise DtbenchError("--address and --workers need --executor ray (the local executor is one worker)")
        return cls(threads=threads_per_worker)

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self.worker: Any = None  # a Worker, or an IsolatedWorker with the same methods (isolation: process)
        self.isolation = "none"
        self.own: dict[str, Any] = {}  # label -> the IsolatedWorker of a decoder measured in its own process
        self.budgets: dict[str, int] | None = None

    def prepare(self, suite: Suite) -> None:
        self.device = models.resolve_device(suite.device)

    def start(self, suite: Suite, plan: Plan, tokenizer, console: Console) -> WorkerInfo:
        from dtbench.harness.execution.isolation import IsolatedWorker, isolation_of

        self.isolation = isolation_of(suite, self.device.type)
        if self.isolation == "process":  # issue 38: the models and every measurement in a child process
            self.suite, self.plan = suite, plan
            with console.status(f"starting the measuring process (isolation: process) on {self.device}"):
                self.worker = IsolatedWorker(suite, str(self.device), plan, self.threads)
        else:
            self.worker = Worker(
                suite, str(self.device), plan=plan, tokenizer=tokenizer, threads=self.threads, status=console.status
            )
        return self.worker.info

    def calibrate(self, contexts, settings, console: Console) -> calibrate.Measured:
        return self.worker.calibrate(contexts, settings, console)

    def set_budgets(self, budgets: dict[str, int]) -> None:
        self.budgets = dict(budgets)
        self.worker.set_budgets(budgets)  # the driver's own plan, resolved already: a no-op kept for symmetry
        for own in self.own.values():
            own.set_budgets(budgets)

    def _worker_for(self, key: str | None) -> Any:
        """The shared worker (key None) or, started on first use, the own process of decoder ``key``."""
        from dtbench.harness.execution.isolation import IsolatedWorker

        if key is None:
            return self.worker
        if key not in self.own:
            own = IsolatedWorker(self.suite, str(self.device), self.plan, self.threads)
            if self.budgets:
                own.set_budgets(self.budgets)
            self.own[key] = own
        return self.own[key]

    def execute(self, groups: Iterable[PromptGroup], sink: Sink) -> None:
        from dtbench.harness.execution.isolation import own_process_segments, remember

        for group in groups:
            done, failed = sink.state(group)
            try:
                prompt = sink.prompt(group)
            except (TurnNotReady, PromptFailed) as exc:  # a later turn that has no prompt: its cells fail
                sink.fail(group, str(exc), self.worker.info)
                continue
            if self.isolation != "process":  # a native crash kills this process: record which cell it measures
                announce = lambda label, group=group: sink.started(group, label)  # noqa: E731
                for outcome in self.worker.run(group, prompt, done, failed, announce=announce):
                    sink.commit(group, outcome, self.worker.info)
                continue
            # issue 38: decoders whose own_process names this device run in a child of their own, in plan order
            done, failed = dict(done), set(failed)
            labels = {cp.label for cp in group.decoders}
            for key, segment in own_process_segments(group.decoders, self.device.type):
                worker = self._worker_for(key)
                for outcome in worker.run(group, prompt, done, failed | (labels - segment)):  # the group itself
                    sink.commit(group, outcome, worker.info)
                    remember(outcome, done, failed)

    def close(self) -> None:
        for worker in [self.worker, *self.own.values()]:
            if worker is not None:
                worker.close()  # launched servers stopped (issue 30)
        self.worker, self.own = None, {}

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "threads": self.threads, "isolation": self.isolation}
        if self.isolation == "process" and self.worker is not None:
            out["processes_started"] = self.worker.children + sum(w.children for w in self.own.values())
            own = sorted({c.label for c in self.plan.decoders if self.device.type in getattr(c.cls, "own_process", ())})
            if own:
                out["own_process"] = own  # measured in a process of their own (issue 38; started on first use)
        return out


# Executors (issue 49 item 3): `dtbench run --executor NAME` looks NAME up in the entry-point group
# `dtbench.executors` (built-ins `local` and `ray` declared in pyproject.toml) through the one registry.
REGISTRY: Registry[type[Executor]] = Registry("dtbench.executors", "executor", subclass_of(Executor))
