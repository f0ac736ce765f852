"""The worker side of a run: the models, and measuring one prompt group with them.

A :class:`Worker` loads the target and draft once and measures whole prompt groups (a reference and every decoder
that depends on it, in plan order, on one device) with :mod:`dtbench.harness.measurement.cells`
(:func:`~dtbench.harness.measurement.cells.run_group` yields one :class:`~dtbench.harness.measurement.cells.Outcome` per decoder as soon as
it is measured). This module owns the worker itself: who measures (:class:`WorkerInfo`) and :class:`Worker`. A unit
of work travels as the plan's :class:`~dtbench.harness.suites.plan.PromptGroup` itself (issue 49 item 5: the local executor,
and pickled to an isolated child). A Ray actor receives the driver's plan once, as a :class:`PlanSnapshot` (the
plan, its decoder classes and validated params, and its prompt groups by :class:`~dtbench.harness.suites.grouping.GroupKey`;
issue 58 item 3: it never plans the suite with its own registry), and each task sends a group's key. It runs in the
driver's process (the local executor) or inside a Ray actor (:mod:`dtbench.harness.execution.ray_executor`); it never touches
the database: the driver (:mod:`dtbench.harness.execution.runner`) commits what it yields.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, overload

import torch
from rich.console import Console

from dtbench.harness.calibration import calibrate, calibrate_run
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.measurement.cells import Outcome, run_group
from dtbench.harness.measurement.hardware import Hardware
from dtbench.harness.measurement.machine import device_name, environment
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.models import fingerprint
from dtbench.harness.models import loading as models
from dtbench.harness.suites.grouping import GroupKey
from dtbench.harness.suites.plan import Plan, PromptGroup
from dtbench.harness.suites.suite import Suite


@dataclass(frozen=True)
class PlanSnapshot:
    """The driver's plan as a Ray actor receives it, once (issue 58 item 3): the plan (its decoder classes and
    validated params: the registry as the driver planned with it, never scanned again by the actor) and every prompt
    group of it by :attr:`~dtbench.harness.suites.plan.PromptGroup.key`, so a task sends a key and the actor looks its group
    up here (no dataset read either: question datasets' slots were read by the driver)."""

    plan: Plan
    groups: Mapping[GroupKey, PromptGroup]

    @classmethod
    def of(cls, plan: Plan) -> PlanSnapshot:
        """The snapshot of the driver's ``plan`` (its groups as :meth:`~dtbench.harness.suites.plan.Plan.groups` gives them)."""
        return cls(plan, {g.key: g for g in plan.groups()})

    def dumps(self) -> bytes:
        """The snapshot pickled (decoder classes by reference: a node must have them installed to load it)."""
        return pickle.dumps(self)

    @staticmethod
    def loads(data: bytes) -> PlanSnapshot:
        """A snapshot from :meth:`dumps`.

        Raises:
            DtbenchError: it cannot be loaded here (a decoder's module not installed: one line saying so).
        """
        try:
            snapshot = pickle.loads(data)
        except Exception as exc:  # ModuleNotFoundError of a plugin the driver has, AttributeError of a renamed class
            raise DtbenchError(
                f"cannot load the driver's plan: {type(exc).__name__}: {clip(exc, 300)}; install the same dtbench and "
                f"plugins on every node"
            ) from None
        assert isinstance(snapshot, PlanSnapshot)
        return snapshot

    def group(self, key: GroupKey) -> PromptGroup:
        """The prompt group of ``key``.

        Raises:
            DtbenchError: a key the plan does not have.
        """
        group = self.groups.get(key)
        if group is None:
            raise DtbenchError(f"the driver's plan has no prompt group {key}")
        return group


def installed_versions(plan: Plan) -> list[tuple[str, str]]:
    """(label, version) of the plan's decoders as installed in this process: the class's own ``version`` and its
    distribution's installed version (:func:`importlib.metadata.version`), written as the plan writes them
    (:attr:`~dtbench.harness.suites.plan.CellPlan.version`), so a Ray actor given the driver's plan still tells a node
    with other plugin versions apart. A distribution that metadata does not know (registered in-process) keeps the
    plan's version."""
    out = []
    for p in plan.decoders:
        try:
            dist_version = metadata.version(p.distribution)
        except (metadata.PackageNotFoundError, ValueError):
            out.append((p.label, p.version))
            continue
        out.append((p.label, f"{p.cls.version} ({p.distribution} {dist_version})"))
    return out


@dataclass
class WorkerInfo:
    """Who measures: a worker's host, process, device and the models it loaded (plain data, sent between processes).

    ``environment`` is :func:`~dtbench.harness.measurement.machine.environment` of the worker's device plus ``target``/``draft``
    descriptions: the first worker's becomes the run's (``runs.environment``). ``decoders`` lists the (label,
    version) of the plan's decoders as installed where the worker runs (:func:`installed_versions`), which must
    equal the driver's.
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


@overload
def model_info(loaded: models.LoadedModel) -> dict[str, Any]: ...


@overload
def model_info(loaded: None) -> None: ...


@overload
def model_info(loaded: models.LoadedModel | None) -> dict[str, Any] | None: ...


def model_info(loaded: models.LoadedModel | None) -> dict[str, Any] | None:
    if loaded is None:
        return None
    from dtbench.harness.calibration.curves_file import model_shape

    remote = {"trust_remote_code": True} if loaded.trust_remote_code else {}  # the opt-in is recorded with the run
    config = getattr(loaded.model, "config", None)
    shape = {"shape": model_shape(config)} if config is not None else {}  # what prices its forwards (issue 48)
    return {"model": loaded.name, "dtype": loaded.dtype, "params": loaded.params, **shape, **remote}


class Worker:
    """Loads the target and draft once and measures prompt groups with them: in the driver's process
    (:class:`~dtbench.harness.execution.executors.LocalExecutor`) or inside a Ray actor
    (:class:`~dtbench.harness.execution.ray_executor.RayExecutor`).

    Args:
        suite: the validated suite; device: ``cpu``/``cuda``/``auto`` as the worker resolves it.
        plan: the driver's plan (a Ray actor's from its :class:`PlanSnapshot`; never planned again here).
        tokenizer: the target's tokenizer, if already loaded (checked against the models' embeddings).
        threads: ``torch.set_num_threads`` for this worker (None: leave it).
        cwd: a folder to change to first, so relative model paths mean what they mean to the driver.
        status: a context-manager factory showing what is loading (the driver's spinner), or None.

    Raises:
        DtbenchError: a model that cannot be loaded or does not fit its tokenizer, or a decoder whose
            ``check_target(params, target)`` refuses the target (a learned head of other sizes).
    """

    def __init__(
        self,
        suite: Suite,
        device: str,
        *,
        plan: Plan,
        tokenizer=None,
        threads: int | None = None,
        cwd: str | None = None,
        status: Callable[[str], Any] | None = None,
    ):
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        if threads:
            torch.set_num_threads(threads)
        status = status or (lambda _text: nullcontext())
        self.suite = suite
        self.plan = plan
        self.device = models.resolve_device(device)
        if tokenizer is None:
            tokenizer = models.load_tokenizer(suite.target)
        self.tokenizer = tokenizer
        from dtbench.harness.serving import ServerPool

        self.servers = ServerPool()  # the servers this worker launches for server cells (issue 30)
        with status(f"loading target {suite.target.model} ({suite.target.dtype}) on {self.device}"):
            self.target = models.load_model(suite.target, self.device)
        loaded = [(self.target, suite.target)]
        self.draft = None
        if suite.draft is not None and any(p.cls.needs_draft for p in self.plan.decoders):
            with status(f"loading draft {suite.draft.model} ({suite.draft.dtype})"):
                self.draft = models.load_model(suite.draft, self.device)
            loaded.append((self.draft, suite.draft))
        warnings = []
        longest = max(l_max for ds in suite.datasets for l_max in ds.l_maxes) + max(suite.generation_lengths)
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
        self.hardware = Hardware.of(self.plan, suite, self.target, self.draft, self.device)
        env = environment(self.device)
        env["memory_bandwidth_bytes_per_s"] = self.hardware.bandwidth  # the roofline's denominator (issue 37)
        env["memory_bandwidth"] = self.hardware.bandwidth_info  # how it was measured; NVML's figure on CUDA
        env["target"], env["draft"] = model_info(self.target), model_info(self.draft)
        env["files"] = fingerprint.run_files(suite, self.plan, self.target, self.draft)  # sha256 / hub commits
        self.info = WorkerInfo(
            host=socket.gethostname(),
            pid=os.getpid(),
            device=str(self.device),
            device_name=device_name(self.device),
            environment=env,
            target=model_info(self.target),
            draft=model_info(self.draft),
            decoders=installed_versions(self.plan),
            warnings=warnings,
        )

    def run(
        self,
        group: PromptGroup,
        prompt,
        done: dict[str, Reference],
        skip: set[str],
        announce: Callable[[str], None] | None = None,
    ) -> Iterator[Outcome]:
        """Measure one prompt group of the plan (see :func:`~dtbench.harness.measurement.cells.run_group`), yielding each
        outcome. A Ray actor looks ``group`` up by its key in the driver's :class:`PlanSnapshot` first."""
        yield from run_group(
            group,
            prompt,
            self.target,
            self.draft,
            self.device,
            self.suite,
            done,
            skip,
            self.plan.data_dir,
            servers=self.servers,
            tokenizer=self.tokenizer,
            hardware=self.hardware,
            announce=announce,
        )

    def close(self) -> None:
        """Stop every server this worker launched (end of run, Ctrl-C, failure); never raises."""
        self.servers.close()

    def calibrate(
        self, contexts: dict[int, list[int]], settings: calibrate.Settings, console: Console | None = None
    ) -> calibrate.Measured:
        """The cost model's curves measured with this worker's models on its device (plain data for the driver)."""
        return calibrate.measure_on(self, contexts, settings, console)

    def set_budgets(self, budgets: dict[str, int]) -> None:
        """Use the driver's resolved ``n_max: auto`` budgets ({label: n_max}) in this worker's plan."""
        calibrate_run.apply_budgets(self.plan, budgets)
