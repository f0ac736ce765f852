"""The Ray executor (issue 11): prompt groups measured on Ray actors, each keeping its loaded target and draft
(see :mod:`dtbench.harness.execution.executors` for the executor protocol); and, before the first cell, the cost model's
calibration measured on one of them (issue 12).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from dtbench.harness.calibration import calibrate
from dtbench.harness.data.chat import PromptFailed, TurnNotReady
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.execution.executors import Executor, Sink
from dtbench.harness.execution.ray_connect import join
from dtbench.harness.execution.worker import PlanSnapshot, Worker, WorkerInfo
from dtbench.harness.measurement.cells import Outcome
from dtbench.harness.suites.grouping import GroupKey
from dtbench.harness.suites.plan import Plan, PromptGroup
from dtbench.harness.suites.suite import Suite

RAY_MISSING = "--executor ray needs Ray, which is not installed: pip install 'dtbench[ray]'"
MAX_ATTEMPTS = 2  # a group whose worker dies is retried once, then its remaining samples fail their cells


CONNECT_TIMEOUT_S = 30.0  # default --connect-timeout: seconds to wait for a given Ray cluster


# The energy extra's Zeus requires amdsmi, whose import raises KeyError (not ImportError) where ROCm's libamd_smi.so is
# missing; Ray (2.60) imports amdsmi in every process at `import ray` and catches only ImportError. So a plain
# `pip install 'dtbench[ray,energy]'` left a Ray that cannot start. dtbench hides such an amdsmi (hide_broken_amdsmi).
AMDSMI_STANDIN = (
    '"""Stand-in dtbench puts first on the PYTHONPATH of the Ray processes it starts: the installed amdsmi '
    'cannot load here."""\nraise ImportError("amdsmi cannot load on this machine (ROCm\'s libamd_smi.so '
    'is missing); dtbench hides it from Ray")\n'
)


def hide_broken_amdsmi() -> bool:
    """Where amdsmi is installed but cannot be imported (no ROCm), make ``import amdsmi`` raise ImportError, which
    Ray handles as "no AMD GPU": in this process (``sys.modules["amdsmi"] = None``) and in the Ray processes it
    starts (a stand-in package first on ``PYTHONPATH``, in a temporary folder removed at exit). Zeus guards its own
    amdsmi import and needs none of it for NVML or RAPL. An amdsmi that imports, or none at all, is left alone.

    Returns:
        True if a broken amdsmi was hidden.
    """
    import atexit
    import contextlib
    import io
    import shutil
    import sys
    import tempfile

    if "amdsmi" in sys.modules:
        return sys.modules["amdsmi"] is None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints its missing-library message to stdout
            import amdsmi  # noqa: F401
    except ImportError:
        return False
    except Exception:  # noqa: BLE001  (KeyError 'libamd_smi.so' / 'ROCM_PATH', OSError: no ROCm)
        for name in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
            del sys.modules[name]
        sys.modules["amdsmi"] = None  # type: ignore[assignment]  # `import amdsmi` -> ImportError
        folder = tempfile.mkdtemp(prefix="dtbench-amdsmi-")
        os.makedirs(os.path.join(folder, "amdsmi"))
        with open(os.path.join(folder, "amdsmi", "__init__.py"), "w") as f:
            f.write(AMDSMI_STANDIN)
        atexit.register(shutil.rmtree, folder, True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
        return True
    return False


def import_ray():
    """The ``ray`` module (a broken amdsmi hidden first: :func:`hide_broken_amdsmi`).

    Raises:
        DtbenchError: one line saying how to install it.
    """
    hide_broken_amdsmi()
    try:
        import ray
    except ImportError:
        raise DtbenchError(RAY_MISSING) from None
    except Exception as exc:  # e.g. amdsmi (a Zeus dependency) installed without ROCm: KeyError 'libamd_smi.so'
        hint = "; amdsmi is installed without ROCm: pip uninstall amdsmi" if "amd" in repr(exc).lower() else ""
        raise DtbenchError(f"Ray cannot be imported: {type(exc).__name__}: {clip(exc, 200)}{hint}") from None
    return ray


class RayWorker:
    """The body of a Ray actor: a :class:`Worker` built in the actor's process from the driver's plan (``plan``: a
    pickled :class:`~dtbench.harness.execution.worker.PlanSnapshot`, sent once per actor; issue 58 item 3: the actor never
    plans the suite with its own registry). Never raises from ``__init__`` (the error comes back from :meth:`ready`,
    as one line), so a bad model or a plugin missing on the node is a user error, not a dead actor. ``budgets``:
    ``n_max: auto`` budgets the driver resolved already (a replacement started mid-run)."""

    def __init__(
        self,
        suite: Suite,
        plan: bytes,
        device: str,
        threads: int | None,
        cwd: str | None,
        budgets: dict[str, int] | None = None,
    ):
        self.worker: Worker | None = None
        self.error: str | None = None
        self.snapshot: PlanSnapshot | None = None
        try:
            self.snapshot = PlanSnapshot.loads(plan)
            self.worker = Worker(suite, device, plan=self.snapshot.plan, threads=threads, cwd=cwd)
            if budgets:
                self.worker.set_budgets(budgets)
        except DtbenchError as exc:
            self.error = str(exc)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {clip(exc, 1000)}"

    def ready(self) -> WorkerInfo | str:
        """The worker's :class:`WorkerInfo`, or the one-line error that kept it from loading its models."""
        if self.worker is None:
            return f"worker on {socket.gethostname()} (pid {os.getpid()}): {self.error}"
        return self.worker.info

    def _loaded(self) -> Worker:
        """The worker: the driver calls the methods below only on an actor whose :meth:`ready` gave its info."""
        assert self.worker is not None, self.error
        return self.worker

    def run(self, key: GroupKey, prompt, done, skip) -> Iterator[Outcome]:
        """A streaming generator: each outcome travels to the driver as soon as it is measured. ``key``: the group's
        :class:`~dtbench.harness.suites.grouping.GroupKey`, looked up in the driver's plan (a DtbenchError if it has none)."""
        worker = self._loaded()
        assert self.snapshot is not None
        yield from worker.run(self.snapshot.group(key), prompt, done, skip)

    def calibrate(self, contexts: dict[int, list[int]], settings: dict) -> calibrate.Measured | str:
        """The cost model's curves measured in this actor (plain data), or the one-line error that stopped it.
        ``settings``: the driver's :class:`~dtbench.harness.calibration.calibrate.Settings` as a dict."""
        try:
            return self._loaded().calibrate(contexts, calibrate.Settings(**settings))
        except Exception as exc:
            where = self._loaded().info.where
            return f"calibrating on Ray worker {where} failed: {type(exc).__name__}: {clip(exc, 1000)}"

    def set_budgets(self, budgets: dict[str, int]) -> None:
        self._loaded().set_budgets(budgets)


@dataclass
class _Actor:
    handle: Any
    ready_ref: Any
    info: WorkerInfo | None = None

    @property
    def loaded(self) -> WorkerInfo:
        """Its :attr:`info`, set once it has loaded its models (every actor the executor hands work to)."""
        assert self.info is not None, "a Ray worker still loading"
        return self.info


class RayExecutor(Executor):
    """Prompt groups on Ray actors, each keeping its loaded target and draft; the driver commits every outcome.

    Args:
        address: a Ray cluster to join (``auto``, ``HOST:PORT``, ``ray://...``); None: ``$RAY_ADDRESS``, else a
            local Ray instance started for this run (and shut down after it).
        workers: number of actors; default one per GPU on CUDA, else the cluster's CPUs // ``threads_per_worker``.
        threads_per_worker: CPUs reserved by each actor (``num_cpus``) and its ``torch.set_num_threads``.
        connect_timeout_s: seconds to wait for a given cluster (``--address``, ``$RAY_ADDRESS``) to answer before
            failing in one line naming it (Ray itself retries forever, and its C++ wait ignores Ctrl-C).
    """

    name = "ray"

    @classmethod
    def from_options(
        cls,
        *,
        address: str | None = None,
        workers: int | None = None,
        threads_per_worker: int | None = None,
        connect_timeout_s: float | None = None,
    ) -> Executor:
        """Ray actors joining ``address`` (see the class); Ray is imported here, so a missing Ray is one line.

        Raises:
            DtbenchError: Ray not installed.
        """
        import_ray()
        timeout = {} if connect_timeout_s is None else {"connect_timeout_s": connect_timeout_s}
        return cls(address=address, workers=workers, threads_per_worker=threads_per_worker, **timeout)

    def __init__(
        self,
        address: str | None = None,
        workers: int | None = None,
        threads_per_worker: int | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        self.address, self.n_workers, self.threads = address, workers, threads_per_worker or 1
        self.connect_timeout_s = connect_timeout_s
        self.ray: Any = None  # the ray module (imported in prepare())
        self._remote: Any = None  # RayWorker as a Ray actor class
        self.started_ray = False
        self.actors: list[_Actor] = []
        self.device = "cpu"
        self.restarts_left = 0
        self.budgets: dict[str, int] = {}  # resolved n_max: auto, handed to every worker (replacements too)
        self.plan_ref: Any = None  # the driver's PlanSnapshot, pickled and put in Ray's object store once (start)

    def prepare(self, suite: Suite) -> None:
        ray = self.ray = import_ray()
        if not ray.is_initialized():
            import logging

            kwargs: dict[str, Any] = dict(logging_level=logging.ERROR, log_to_driver=True)
            if self.address is None and not os.environ.get("RAY_ADDRESS"):
                kwargs["include_dashboard"] = False  # a local instance of our own: nothing to look at
            joining = self.address or os.environ.get("RAY_ADDRESS")
            try:
                if joining:
                    join(ray, joining, kwargs, self.connect_timeout_s)
                else:
                    ray.init(address=self.address, **kwargs)
            except DtbenchError:
                raise
            except Exception as exc:
                raise DtbenchError(
                    f"cannot start or join Ray (address {self.address or 'local'}): "
                    f"{type(exc).__name__}: {clip(exc, 300)}"
                ) from None
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
                raise DtbenchError(
                    f"--workers {n} x --threads-per-worker {self.threads} needs {n * self.threads} CPUs; "
                    f"the Ray cluster has {cpus}"
                )
        self.n_workers = n
        self.restarts_left = 2 * n + 2

    def _spawn(self, suite: Suite) -> _Actor:
        if self._remote is None:
            self._remote = self.ray.remote(RayWorker).options(
                num_cpus=self.threads, num_gpus=1 if self.device == "cuda" else 0, max_restarts=0, max_concurrency=1
            )
        handle = self._remote.remote(suite, self.plan_ref, self.device, self.threads, os.getcwd(), self.budgets or None)
        return _Actor(handle, handle.ready.remote())

    def start(self, suite: Suite, plan: Plan, tokenizer, console: Console) -> WorkerInfo:
        assert self.n_workers is not None, "prepare() sets the number of workers"
        ray = self.ray
        self.suite, self.plan = suite, plan
        self.plan_ref = ray.put(PlanSnapshot.of(plan).dumps())  # once: every actor (and replacement) gets this plan
        self.actors = [self._spawn(suite) for _ in range(self.n_workers)]
        expected = [(p.label, p.version) for p in plan.decoders]
        pending = {a.ready_ref: a for a in self.actors}
        with console.status(
            f"starting {self.n_workers} Ray worker(s) on {self.device}: loading "
            f"{suite.target.model} and the draft on each"
        ) as spinner:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    actor = pending.pop(ref)
                    actor.info = self._ready(ref)
                    if actor.info.decoders != expected:
                        raise DtbenchError(
                            f"Ray worker {actor.info.where} has other decoders or versions than this "
                            f"driver: {_diff(actor.info.decoders, expected)}; install the same dtbench "
                            f"and plugins on every node"
                        )
                spinner.update(
                    f"starting {self.n_workers} Ray worker(s) on {self.device}: {self.n_workers - len(pending)} ready"
                )
        infos = [a.loaded for a in self.actors]
        names = sorted({i.device_name for i in infos})
        if len(names) > 1:
            console.print(
                f"[yellow]warning: the Ray workers have different devices ({'; '.join(names)}); a cell "
                f"measured on several is flagged in the report[/yellow]"
            )
        infos[0].warnings = sorted({w for i in infos for w in i.warnings})
        return infos[0]

    def calibrate(self, contexts, settings, console: Console) -> calibrate.Measured:
        """Calibrate on the first worker (the one whose environment is the run's): one calibration per run."""
        from ray.exceptions import RayActorError

        actor = self.actors[0]
        names = sorted({a.loaded.device_name for a in self.actors})
        if len(names) > 1:
            console.print(
                f"[yellow]warning: the Ray workers have different devices; the cost model's curves come "
                f"from {actor.loaded.device_name} ({actor.loaded.host}) only[/yellow]",
                highlight=False,
            )
        # a line, not a spinner: the run's progress bar is already live
        console.print(f"calibrating the cost model on Ray worker {actor.loaded.where}", highlight=False)
        try:
            measured = self.ray.get(actor.handle.calibrate.remote(contexts, dataclasses.asdict(settings)))
        except RayActorError as exc:
            raise DtbenchError(f"Ray worker {actor.loaded.where} died while calibrating: {_one_line(exc)}") from None
        if isinstance(measured, str):
            raise DtbenchError(measured)
        return measured

    def set_budgets(self, budgets: dict[str, int]) -> None:
        from ray.exceptions import RayActorError

        self.budgets = dict(budgets)
        try:
            self.ray.get([a.handle.set_budgets.remote(self.budgets) for a in self.actors])
        except RayActorError as exc:
            raise DtbenchError(f"a Ray worker died before the first cell: {_one_line(exc)}") from None

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
                try:
                    prompt = sink.prompt(group)
                except TurnNotReady as exc:  # a later turn: its earlier turn's reference is still running, or failed
                    if running:
                        queue.append(group)
                        break
                    sink.fail(group, str(exc), None)
                    continue
                except PromptFailed as exc:  # the chat template failed on a later turn: its cells fail
                    sink.fail(group, str(exc), None)
                    continue
                actor = idle.popleft()
                gen = actor.handle.run.options(num_returns="streaming").remote(group.key, prompt, done, skip)
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
                sink.commit(group, outcome, actor.loaded)

    def _lost(self, actor: _Actor, group: PromptGroup, exc: Exception, queue, attempts, starting, sink) -> None:
        """A worker died mid-group: retry the group once (first in the queue), else fail its remaining samples;
        start a replacement worker while the restart budget lasts."""
        self._kill(actor)
        key = group.key
        attempts[key] = attempts.get(key, 0) + 1
        what = (
            f"Ray worker {actor.loaded.where} died while measuring {group.dataset.key} L_max={group.l_max} "
            f"T={group.gen_length} prompt {group.prompt_index}: {_one_line(exc)}"
        )
        if attempts[key] < MAX_ATTEMPTS:
            sink.note(f"{what}; retrying the group on another worker")
            queue.appendleft(group)
        else:
            sink.note(f"{what}; it was the group's second attempt, so its remaining samples fail their cells")
            sink.fail(group, f"prompt {group.prompt_index}: the worker died (twice): {_one_line(exc, 300)}", actor.info)
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
        return {
            "name": self.name,
            "address": self.address,
            "workers": self.n_workers,
            "threads_per_worker": self.threads,
            "device": self.device,
        }


def _one_line(exc: BaseException, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return clip(f"{type(exc).__name__}: {lines[0] if lines else ''}", limit)


def _diff(got: list[tuple[str, str]], expected: list[tuple[str, str]]) -> str:
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    parts = [
        f"it has {', '.join(f'{label} {v}' for label, v in extra)}" if extra else "",
        f"it lacks {', '.join(f'{label} {v}' for label, v in missing)}" if missing else "",
    ]
    return clip("; ".join(p for p in parts if p) or "the same decoders in another order", 300)
