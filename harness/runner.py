"""The measurement loop: expand a suite into cells, drive decoders, time every Step, store every sample.

Cells are dataset x prompt cap x T x decoder. For each (dataset, cap, T) group and each prompt, the reference
decoders (``ar``, and any other decoder's declared reference) run first, then the rest, so every sample is
checked token for token against its reference as soon as it is measured. Each sample is committed at once:
a killed run loses at most the sample in flight, and ``--resume`` continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import platform
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dtbench.decoders.base import Decoder, DecoderParams, Step
from dtbench.harness import data, models, registry
from dtbench.harness.db import Cell, Run, Sample, utcnow
from dtbench.harness.errors import DtbenchError
from dtbench.harness.measure import MemoryTracker, device_name, cpu_model, now, synchronize
from dtbench.harness.suite import DecoderSpec, Suite, suite_hash


@dataclass
class Measurement:
    """What the runner saw of one decoder on one prompt (times in seconds from the start of generate)."""

    tokens: list[int]
    steps: list[Step]
    step_times: list[float]
    memory: Any


def measure(decoder: Decoder, prompt_ids: list[int] | tuple[int, ...], gen_length: int, device: torch.device) -> Measurement:
    """Run ``decoder`` on one prompt and time each yielded Step after synchronizing the device.

    The clock starts right before ``generate`` is called (prefill included) and reads after each Step; the
    committed tokens are truncated to exactly ``gen_length`` (T) and iteration stops once T are committed.

    Args:
        prompt_ids: prompt token ids (length >= 1).
        gen_length: T, new tokens to generate.
        device: where the models live (CUDA is synchronized before each clock read).

    Raises:
        DtbenchError: if the decoder yields an empty step or stops before T tokens.
        Exception: whatever the decoder raises (the runner marks the cell failed).
    """
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    tokens: list[int] = []
    steps: list[Step] = []
    times: list[float] = []
    synchronize(device)
    with MemoryTracker(device) as mem:
        start = now()
        gen = decoder.generate(input_ids, gen_length)
        try:
            for step in gen:
                synchronize(device)
                times.append(now() - start)
                if not step.tokens:
                    raise DtbenchError(f"decoder yielded a step with no tokens at iteration {len(steps)}")
                steps.append(step)
                tokens.extend(step.tokens)
                if len(tokens) >= gen_length:
                    break
        finally:
            gen.close()
    if len(tokens) < gen_length:
        raise DtbenchError(f"decoder stopped after {len(tokens)} of {gen_length} tokens")
    return Measurement(tokens=tokens[:gen_length], steps=steps, step_times=times, memory=mem.peak)


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where ``tokens`` and ``reference`` differ (a length mismatch counts), or None."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def sample_row(m: Measurement, prompt: data.Prompt, warmup: bool, reference: list[int] | None) -> dict[str, Any]:
    """The samples-table columns of one measurement (DESIGN.md "Metrics").

    throughput = T / total wall time (tokens/s); TTFT = time to the first committed token (prefill included);
    TPOT = (total - TTFT) / (T - 1); tokens per iteration L = T / iterations; acceptance rate = committed draft
    tokens / drafted depth, summed over iterations (accepted / K for linear speculation; for trees, the committed
    path length before the bonus token over the depth of the drafted tree; the paper's Table 3 "Accept.");
    mean path length = mean committed path length before the bonus token over iterations that drafted.
    """
    T = len(m.tokens)
    total, ttft = m.step_times[-1], m.step_times[0]
    iterations = len(m.steps)
    drafted = sum(s.drafted for s in m.steps)
    accepted = sum(s.accepted for s in m.steps)
    depth = sum(s.depth for s in m.steps)
    drafting = [s for s in m.steps if s.drafted > 0]
    div = first_divergence(m.tokens, reference) if reference is not None else None
    return dict(
        prompt_index=prompt.index,
        document=prompt.document[:500],
        warmup=warmup,
        prompt_tokens=len(prompt.token_ids),
        new_tokens=T,
        total_s=total,
        ttft_s=ttft,
        tpot_s=(total - ttft) / (T - 1) if T > 1 else None,
        throughput=T / total if total > 0 else float("inf"),
        iterations=iterations,
        tokens_per_iteration=T / iterations,
        drafted=drafted,
        accepted=accepted,
        draft_depth=depth,
        acceptance_rate=accepted / depth if depth else None,
        mean_path_length=sum(s.accepted for s in drafting) / len(drafting) if drafting else None,
        target_forwards=sum(s.target_forwards for s in m.steps),
        step_tokens=[len(s.tokens) for s in m.steps],
        step_stats={
            "drafted": [s.drafted for s in m.steps],
            "accepted": [s.accepted for s in m.steps],
            "tree_size": [s.tree_size for s in m.steps],
            "depth": [s.depth for s in m.steps],
        },
        step_times_s=m.step_times,
        peak_rss_bytes=m.memory.rss_bytes,
        peak_allocated_bytes=m.memory.allocated_bytes,
        peak_nvml_bytes=m.memory.nvml_bytes,
        output_hash=hashlib.sha256(json.dumps(m.tokens).encode()).hexdigest(),
        output_tokens=m.tokens,
        lossless=(div is None) if reference is not None else None,
        first_divergence=div,
    )


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
        DtbenchError: unknown dataset or decoder, invalid params, a draft-needing decoder without a draft model.
    """
    for ds in suite.datasets:
        data.check_dataset(ds)
    entries = registry.discover()
    plans: list[CellPlan] = []
    skipped: list[str] = []
    for spec in suite.expanded_decoders():
        if spec.optional and spec.name not in entries:
            skipped.append(spec.display)
            continue
        cls = registry.get(spec.name)
        params = registry.validate_params(spec.name, spec.params)
        if cls.needs_draft and suite.draft is None:
            raise DtbenchError(f"decoder '{spec.display}' needs a draft model: add `draft:` to the suite")
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
            by_key[key] = rp
            plans.append(rp)
            queue.append(rp)
        p.reference_label = by_key[key].spec.display
    return Plan(suite=suite, decoders=_reference_order(plans), skipped=skipped)


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


def run_suite(
    suite: Suite,
    suite_text: str,
    sessions: sessionmaker[Session],
    *,
    suite_path: str | None = None,
    data_dir: str | None = None,
    resume: int | None = None,
    console: Console | None = None,
    progress: bool = True,
) -> int:
    """Run a suite and store every sample; return the run id.

    Args:
        suite, suite_text: the validated suite and its YAML text (stored with the run).
        sessions: a session factory from ``db.connect``.
        data_dir: local dataset folder (else the suite's, ``DTBENCH_DATA_DIR`` or the hub).
        resume: id of an interrupted run of the same suite to continue (completed samples are skipped).
        console: where progress goes (stderr by default).

    Raises:
        DtbenchError: bad suite/models/data (before the run row is written), or RunInterrupted on Ctrl-C.
    """
    console = console or Console(stderr=True)
    plan = plan_suite(suite)
    for label in plan.skipped:
        console.print(f"[yellow]note: optional decoder '{label}' is not installed; skipped[/yellow]")
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
    draft = None
    if suite.draft is not None and any(p.cls.needs_draft for p in plan.decoders):
        with console.status(f"loading draft {suite.draft.model} ({suite.draft.dtype})"):
            draft = models.load_model(suite.draft, device)
        models.check_vocab(target.model, draft.model, suite.target.model, suite.draft.model)

    with sessions() as session:
        run = _open_run(session, suite, suite_text, suite_path, resume, device, target, draft)
        run_id = run.id
        cells = _open_cells(session, run, plan, target, draft)
        session.commit()

    groups = [(ds, cap, T) for ds in suite.datasets for cap in ds.caps for T in suite.generation_lengths]
    total = sum(len(plan.decoders_for(ds.name)) * ds.prompts for ds, cap, T in groups)
    status = "completed"
    try:
        with _sigterm_as_interrupt(), Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=console, disable=not progress, transient=False,
        ) as bar:
            task = bar.add_task("starting", total=total)
            for ds, cap, T in groups:
                decs = plan.decoders_for(ds.name)
                for prompt in prompts[(ds.name, cap)]:
                    outputs: dict[str, list[int]] = {}
                    for cp in decs:
                        bar.update(task, description=f"{ds.name} L={cap} T={T} · {cp.spec.display} · prompt {prompt.index + 1}/{ds.prompts}")
                        _run_one(sessions, cells[(ds.name, cap, T, cp.spec.display)], cp, prompt, T,
                                 prompt.index < ds.warmup, outputs, target, draft, device, suite.seed)
                        bar.advance(task)
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        with sessions() as session:
            run = session.get(Run, run_id)
            run.status = status
            run.finished_at = utcnow()
            for cell in run.cells:
                if cell.status != "failed":
                    cell.status = "done" if status == "completed" else "pending"
            session.commit()
    if status == "interrupted":
        raise RunInterrupted(f"run {run_id} interrupted; measured samples are kept (continue with --resume-run {run_id})")
    return run_id


_RESUME_MUST_MATCH = ("dtbench", "torch", "transformers", "device", "device_name", "target", "draft")


def _open_run(session, suite, suite_text, suite_path, resume, device, target, draft) -> Run:
    env = environment(device)
    env["target"] = {"model": target.name, "dtype": target.dtype, "params": target.params}
    env["draft"] = {"model": draft.name, "dtype": draft.dtype, "params": draft.params} if draft else None
    if resume is None:
        run = Run(suite_name=suite.name, suite_path=suite_path, suite_text=suite_text, suite_hash=suite_hash(suite_text),
                  status="running", environment=env)
        session.add(run)
        session.flush()
        return run
    run = session.get(Run, resume)
    if run is None:
        raise DtbenchError(f"no run {resume} to resume")
    if run.suite_hash != suite_hash(suite_text):
        raise DtbenchError(f"run {resume} was made from a different suite text ({run.suite_name}); cannot resume it with this one")
    # Samples of one run must come from one environment, or its comparisons mean nothing.
    changed = [k for k in _RESUME_MUST_MATCH if run.environment.get(k) != env.get(k)]
    if changed:
        k = changed[0]
        raise DtbenchError(f"run {resume} was measured with {k} = {run.environment.get(k)!r}, this machine has "
                           f"{env.get(k)!r}; start a new run instead of resuming")
    run.status = "running"
    run.finished_at = None
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


def _run_one(sessions, cell_id, cp: CellPlan, prompt, T, warmup, outputs, target, draft, device, seed) -> None:
    """Measure one (cell, prompt) unless already stored or the cell failed; commit the sample at once."""
    label = cp.spec.display
    with sessions() as session:
        cell = session.get(Cell, cell_id)
        if cell.status == "failed":
            return
        done = session.scalar(select(Sample).where(Sample.cell_id == cell_id, Sample.prompt_index == prompt.index))
        if done is not None:
            outputs[label] = done.output_tokens
            return
        cell.status = "running"
        session.commit()
    reference = outputs.get(cp.reference_label) if cp.reference_label else None
    if cp.reference_label and reference is None:
        _fail(sessions, cell_id, f"reference decoder '{cp.reference_label}' has no output for prompt {prompt.index}")
        return
    try:
        torch.manual_seed(seed)
        decoder = cp.cls(target.model, draft.model if (draft and cp.cls.needs_draft) else None, cp.params)
        m = measure(decoder, prompt.token_ids, T, device)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # a decoder failing mid-run fails its cell, never the run
        _fail(sessions, cell_id, f"prompt {prompt.index}: {type(exc).__name__}: {exc}")
        return
    outputs[label] = m.tokens
    with sessions() as session:
        session.add(Sample(cell_id=cell_id, **sample_row(m, prompt, warmup, reference)))
        session.commit()


def _fail(sessions, cell_id: int, message: str) -> None:
    with sessions() as session:
        cell = session.get(Cell, cell_id)
        cell.status, cell.error = "failed", message[:2000]
        session.commit()
