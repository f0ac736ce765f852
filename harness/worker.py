"""The worker side of a run: the models, and measuring one prompt group with them.

A :class:`Worker` loads the target and draft once and measures whole prompt groups (a reference and every decoder
that depends on it, in plan order, on one device) with :mod:`dtbench.harness.cells`
(:func:`~dtbench.harness.cells.run_group` yields one :class:`~dtbench.harness.cells.Outcome` per decoder as soon as
it is measured). This module owns the worker itself: who measures (:class:`WorkerInfo`) and :class:`Worker`. A unit
of work travels as the plan's :class:`~dtbench.harness.plan.PromptGroup` itself (issue 49 item 5: the local executor,
and pickled to an isolated child); the 7-tuple :func:`work_key` is kept for the Ray executor, whose actors plan the
suite themselves and look the group up by it. It runs in the driver's process (the local executor) or inside a Ray
actor (:mod:`dtbench.harness.ray_executor`); it never touches the database: the driver (:mod:`dtbench.harness.runner`)
commits what it yields.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, overload

import torch
from rich.console import Console

from dtbench.harness import calibrate, calibrate_run, fingerprint, models
from dtbench.harness.cells import Hardware, Outcome, run_group
from dtbench.harness.errors import DtbenchError
from dtbench.harness.machine import device_name, environment
from dtbench.harness.plan import Plan, PromptGroup, plan_suite
from dtbench.harness.sample import Reference
from dtbench.harness.suite import Suite

WorkKey = tuple[str, int, int, int, int, int, bool]  # (dataset, L_max, T, B, first prompt index, repeat, served)


def work_key(group: PromptGroup) -> WorkKey:
    """The key of a unit of work shipped to a worker: its cells' group (dataset, L_max, T, B), the (first) prompt
    index, the repeat, and whether it is a server cell's whole-cell unit (:func:`~dtbench.harness.grouping.cell_units`:
    it starts at the same prompt as a group of dtbench's own decoders at the same point)."""
    served = bool(group.decoders) and all(cp.cls.requests for cp in group.decoders)
    return (
        group.dataset.key,
        group.l_max,
        group.gen_length,
        group.batch_size,
        group.prompt_index,
        group.repeat,
        served,
    )


@dataclass
class WorkerInfo:
    """Who measures: a worker's host, process, device and the models it loaded (plain data, sent between processes).

    ``environment`` is :func:`~dtbench.harness.machine.environment` of the worker's device plus ``target``/``draft``
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


@overload
def model_info(loaded: models.LoadedModel) -> dict[str, Any]: ...


@overload
def model_info(loaded: None) -> None: ...


@overload
def model_info(loaded: models.LoadedModel | None) -> dict[str, Any] | None: ...


def model_info(loaded: models.LoadedModel | None) -> dict[str, Any] | None:
    if loaded is None:
        return None
    from dtbench.harness.curves_file import model_shape

    remote = {"trust_remote_code": True} if loaded.trust_remote_code else {}  # the opt-in is recorded with the run
    config = getattr(loaded.model, "config", None)
    shape = {"shape": model_shape(config)} if config is not None else {}  # what prices its forwards (issue 48)
    return {"model": loaded.name, "dtype": loaded.dtype, "params": loaded.params, **shape, **remote}


class Worker:
    """Loads the target and draft once and measures prompt groups with them: in the driver's process
    (:class:`~dtbench.harness.executors.LocalExecutor`) or inside a Ray actor
    (:class:`~dtbench.harness.ray_executor.RayExecutor`).

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

    def __init__(
        self,
        suite: Suite,
        device: str,
        *,
        plan: Plan | None = None,
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
        self.plan = plan if plan is not None else plan_suite(suite)
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
        self.groups = {work_key(g): g for g in self.plan.groups()}
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
            decoders=[(p.label, p.version) for p in self.plan.decoders],
            warnings=warnings,
        )

    def run(
        self,
        unit: PromptGroup | WorkKey,
        prompt,
        done: dict[str, Reference],
        skip: set[str],
        announce: Callable[[str], None] | None = None,
    ) -> Iterator[Outcome]:
        """Measure one prompt group (see :func:`~dtbench.harness.cells.run_group`), yielding each outcome.

        Args:
            unit: the plan's :class:`~dtbench.harness.plan.PromptGroup` itself, or (Ray actors, which plan the suite
                themselves) its :func:`work_key`, looked up in this worker's plan.

        Raises:
            DtbenchError: a work key this worker's plan does not have.
        """
        group = self.groups.get(unit) if isinstance(unit, tuple) else unit
        if group is None:
            raise DtbenchError(f"this worker's plan has no prompt group {unit}")
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
