"""Calibration of the cost model: forward-latency curves of a suite's target and draft (issue 12).

``dtbench calibrate SUITE`` (standalone) or ``calibrate: true`` in a suite (before the first cell, linked to the
run) measures, for the suite's target and draft on its device and with the forward helper the decoders use
(:func:`dtbench.decoders.kv.forward`), the latency of ONE forward over ``n`` new tokens on a KV cache holding
``cache_len`` positions, for every kind of forward the suite's decoders run:

- ``causal``: plain causal attention, logits for every new token (AR steps, chain verification);
- ``tree``: an explicit 4D tree mask (:func:`~dtbench.decoders.tree.tree_attention_mask`) and tree position ids
  (tree verification, per-level tree drafting; StreamingLLM's masked forwards are priced on it too);
- ``last``: logits of the last position only (``logits_to_keep=1``: chain drafting, a tree session's first draft
  forward, the rebuild strategy's re-run);
- ``prefill``: the prompt (``cache_len = 0``, last position's logits only);
- ``batched`` (suites with batch sizes B > 1, issue 29): the target's verification of B rows together, n new tokens per
  row, through :class:`~dtbench.decoders.kv.RaggedBatch` (per-row 4D masks) — the (B, new tokens) grid the batch
  cost model prices a cell at B with (stored with ``rows`` = B).

``n`` runs over a grid (every n up to 16, then 24, 32, 48, 64, 96, ... up to the largest tree or chain the suite's
decoders can build); ``cache_len`` over the suite's prompt lengths L_max and L_max + max(T) (the cache grows while
decoding; the cost model interpolates between the two). Every point is timed device-synchronized and interleaved
with all the others (:func:`measure_interleaved`): ``Settings.passes`` passes (3), each over every point in its own
seeded random order; a point gets a warmup forward at its first visit, and each visit its share of at least
``min_repeats`` timed forwards and ``min_time_s`` seconds (at most ``max_time_s``); its median is over all its
visits, so a slow spell of a shared machine lands on scattered points of every curve, not on one curve's. The mask,
position ids and tokens are built before the clock starts: what is timed is the model forward alone, so decoder
overhead (mask building, cache copies, host syncs) shows up in the cost model's efficiency, not in its prediction.
(The GPU check's quick curves are timed point after point until stable: :func:`measure_curve`.)

Storage (table ``calibrations``, :class:`dtbench.harness.store.db.Calibration`): one row per point, all rows of one
calibration sharing ``batch``. A suite's calibration has ``run_id`` = its run; a standalone calibration has
``run_id`` NULL and no ``runs`` row (a runs row without cells would become "the latest run" of ``dtbench report``);
the cost model matches it to a run by target/draft model, dtype, device and device name.

Where it is measured: on the worker that measures the cells (:mod:`dtbench.harness.execution.executors`). The local executor's
worker is the driver's process; with ``--executor ray`` the first Ray actor calibrates (one calibration per run: a
cluster's workers have the same kind of device; if their device names differ, a one-line warning says the curves
come from that worker's device). The worker sends its points back as plain data (:class:`Measured`: points plus its
host, pid, device and device name); the driver stores them (rows' ``device``/``device_name`` are the worker's) and
records the worker under ``runs.environment["calibration"]``.

``n_max: auto`` (tree decoders, an extension of the paper's fixed N_max = 256): the runner resolves it before the
first cell from the calibrated target tree-verify curve at the decoder's first prompt length — the largest
calibrated n whose verify cost (root + n drafted nodes) is at most ``n_max_factor`` x the cost of one AR token
(see :func:`~dtbench.harness.calibration.curves.auto_budget`). The driver resolves it in its plan, records it in the cells'
params and hands the budgets to every worker (each Ray actor plans the suite itself), so the decoders run what the
cells record. Storing a calibration, ``n_max: auto`` and the runner's step before the first cell are
:mod:`dtbench.harness.calibration.calibrate_run`'s; this module measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:  # torch is imported lazily, so `dtbench --help` stays fast
    import torch

    from dtbench.harness.measurement.forwards import StopRule

# torch, numpy and the measurement module are imported where used: `dtbench --help` stays fast.

SMALL = 16  # every n up to here is calibrated (CPU kernels make the curve non-monotonic at small n)
LARGE = (24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
THIN = (1, 2, 3, 4, 6, 8, 12, 16)  # the grid of the kinds only small forwards use (drafting, rebuild re-runs)
KINDS = {"causal": (False, False), "tree": (True, False), "last": (False, True)}  # kind -> (tree_mask, last_only)
BATCHED = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)  # n of the batched curves (B > 1), up to the largest verify


def n_grid(n_max: int) -> list[int]:
    """The calibrated n: 1..min(16, n_max), then :data:`LARGE` values below n_max, then n_max itself."""
    n_max = max(1, int(n_max))
    return sorted({*range(1, min(SMALL, n_max) + 1), *(n for n in LARGE if n < n_max), n_max})


@dataclass
class Settings:
    """When one point's timing stops (see the module docstring): over all its visits (``passes``), at least
    ``min_repeats`` forwards and ``min_time_s`` seconds, at most ``max_time_s`` (point by point, :func:`time_point`:
    also stopped once the median is stable within ``rel_tol``). Stated as the forward timer's stop rules by
    :func:`point_rule` and :func:`visit_rule` (issue 58 item 5)."""

    min_repeats: int = 5
    min_time_s: float = 0.1
    max_time_s: float = 1.0
    rel_tol: float = 0.05
    warmup: int = 1
    passes: int = 3  # interleaved passes over every point (measure_interleaved)
    grown_cache: bool = True  # also calibrate on L_max + max(T) cached positions (else L_max only)


@dataclass(frozen=True)
class Curve:
    """One curve to measure: a role's forwards of one kind on one cache length, over ``ns``."""

    role: str
    kind: str  # causal | tree | last | prefill | batched
    cache_len: int
    prompt_len: int
    ns: tuple[int, ...]
    rows: int = 1  # batched: B rows of n new tokens each (kv.RaggedBatch, a per-row 4D mask)

    @property
    def tree_mask(self) -> bool:
        return self.kind in ("tree", "batched")

    @property
    def last_only(self) -> bool:
        return self.kind in ("last", "prefill")


@dataclass
class Point:
    """One measured point (a ``calibrations`` row without the run/batch columns)."""

    role: str
    model: str
    dtype: str
    prompt_len: int
    cache_len: int
    n: int
    tree_mask: bool
    last_only: bool
    median_s: float
    iqr_s: float
    repeats: int
    rows: int = 1


@dataclass
class Measured:
    """A calibration as the worker that measured it hands it to the driver (plain data, sent between processes)."""

    points: list[Point]
    host: str
    pid: int
    device: str  # str(torch.device) on the worker: cpu, cuda:0
    device_name: str  # machine.device_name on the worker

    @property
    def where(self) -> dict:
        """Who measured it (``runs.environment["calibration"]``)."""
        return {"host": self.host, "pid": self.pid, "device": self.device, "device_name": self.device_name}


# --- what to calibrate ------------------------------------------------------------------------------------------


def decoder_sizes(plan) -> tuple[int, int]:
    """(largest causal verification, largest masked verification) the plan's decoders can run, in tokens incl. the
    pending one, from each decoder's declared :meth:`~dtbench.decoders.base.Decoder.verify_sizes`; the second is 0
    when no decoder passes a 4D mask."""
    chain, tree = 1, 0
    for cp in plan.decoders:
        causal, masked = cp.cls.verify_sizes(cp.params)
        chain, tree = max(chain, int(causal)), max(tree, int(masked))
    return chain, tree


def curves_for(plan, suite, uses_draft: bool, grown_cache: bool = True) -> list[Curve]:
    """The curves a suite needs: per role, kind and cache length (module docstring)."""
    chain, tree = decoder_sizes(plan)
    l_maxes = sorted({c for ds in suite.datasets for c in ds.l_maxes})
    T = max(suite.generation_lengths)
    out: list[Curve] = []
    roles = ["target", *(["draft"] if uses_draft else [])]
    for l_max in l_maxes:
        for role in roles:
            for cache_len in sorted({l_max, l_max + T} if grown_cache else {l_max}):
                if role == "target":
                    out.append(Curve(role, "causal", cache_len, l_max, tuple(n_grid(max(chain, SMALL)))))
                else:
                    out.append(Curve(role, "causal", cache_len, l_max, THIN))
                if tree:
                    out.append(Curve(role, "tree", cache_len, l_max, tuple(n_grid(max(tree, 8)))))
                out.append(Curve(role, "last", cache_len, l_max, THIN))
            out.append(Curve(role, "prefill", 0, l_max, tuple(sorted({max(1, l_max // 2), l_max}))))
        # batch sizes B > 1 (issue 29): the target's batched verification over a (B, n) grid; drafts run per row
        # (batch 1), priced on the curves above
        largest = max(chain, tree, 1)
        ns = tuple(n for n in BATCHED if n < largest) + (min(largest, BATCHED[-1]),)
        for b in sorted(b for b in getattr(suite, "batch_sizes", [1]) if b > 1):
            for cache_len in sorted({l_max, l_max + T // 2}):
                out.append(Curve("target", "batched", cache_len, l_max, tuple(sorted(set(ns))), rows=b))
            # the prefill of B prompts in one forward (cache_len 0): what a cell at B pays before its first token
            out.append(Curve("target", "batched", 0, l_max, (l_max,), rows=b))
    return out


# --- measuring ---------------------------------------------------------------------------------------------------


def point_rule(settings: Settings) -> StopRule:
    """The stop rule of one point timed point by point (:func:`time_point`): ``min_repeats`` forwards and
    ``min_time_s`` seconds and a median stable within ``rel_tol``, or ``max_time_s`` with at least 3 forwards."""
    from dtbench.harness.measurement.forwards import StopRule

    return StopRule(settings.min_repeats, settings.min_time_s, settings.max_time_s, settings.rel_tol, floor=3)


def visit_rule(settings: Settings) -> StopRule:
    """The stop rule of one visit of an interleaved point (:func:`measure_interleaved`): its share of the point,
    ceil(``min_repeats`` / passes) forwards and ``min_time_s`` / passes seconds, or ``max_time_s`` / passes seconds
    (at least one forward)."""
    from dtbench.harness.measurement.forwards import StopRule

    passes = max(1, settings.passes)
    return StopRule(-(-settings.min_repeats // passes), settings.min_time_s / passes, settings.max_time_s / passes)


def time_point(
    run_once: Callable[[], object],
    reset: Callable[[], object],
    device: torch.device,
    settings: Settings,
    clock: Callable[[], float] | None = None,
) -> tuple[float, float, int]:
    """(median s, IQR s, repeats) of ``run_once`` timed by the forward timer (:class:`ForwardTimer` on ``device``,
    or on ``clock`` where given, synchronized before each call) in one session under :func:`point_rule`; ``reset``
    (untimed) after each call."""
    from dtbench.harness.measurement.forwards import ForwardTimer

    timer = ForwardTimer(device, clock)
    latency = timer.session(run_once, point_rule(settings), reset=reset, warmup=settings.warmup)
    return latency.median, latency.iqr, latency.repeats


def _tree_inputs(model, n: int, cache_len: int):
    """Position ids and a 4D tree mask of a binary tree of n nodes (root first) after ``cache_len`` positions."""
    import torch

    from dtbench.decoders.tree import ancestor_matrix, attention_mask_kind, tree_attention_mask, tree_position_ids

    parents = torch.tensor([0] + [(i - 1) // 2 for i in range(1, n)], dtype=torch.long, device=model.device)
    anc = ancestor_matrix(parents)
    depths = anc.sum(dim=1) - 1
    mask = tree_attention_mask(anc, cache_len, attention_mask_kind(model), model.dtype)
    return tree_position_ids(depths, cache_len), mask


def _tokens(context: list[int], length: int) -> list[int]:
    """``length`` token ids taken from ``context`` (repeated when it is shorter)."""
    if not context:
        context = [1]
    reps = -(-length // len(context))
    return (context * reps)[:length]


def measure_curve(
    model: torch.nn.Module,
    curve: Curve,
    context: list[int],
    device: torch.device,
    settings: Settings,
    clock: Callable[[], float] | None = None,
) -> list[tuple[int, float, float, int]]:
    """(n, median s, IQR s, repeats) of each n of ``curve`` with ``model``, point after point (:func:`time_point`;
    the GPU check's quick curves; a suite's calibration interleaves its points: :func:`measure_interleaved`).

    Raises:
        ValueError: a tree curve for a model whose attention implementation cannot take a tree mask.
    """
    import torch

    with torch.inference_mode():
        point = _forwards(model, curve, context, {})
        return [(n, *time_point(*point(n), device, settings, clock)) for n in curve.ns]


Forward = tuple[Callable[[], object], Callable[[], object]]  # (one timed forward, its untimed reset)


def _forwards(model, curve: Curve, context: list[int], caches: dict) -> Callable[[int], Forward]:
    """For ``curve``: n -> (one forward of n new tokens, the reset that drops what it added), on a cache (or a batch
    of ``curve.rows`` rows) holding ``curve.cache_len`` positions of ``context``, built once and kept in ``caches``
    (keyed by model, prompt and cache length, rows: the curves of one cache share it, every reset crops back to it); a
    curve with ``cache_len`` 0 times the prefill into a fresh cache (batch).

    Batched curves go through :class:`~dtbench.decoders.kv.RaggedBatch` (the batched loops' forward: per-row mask and
    position ids built inside the timed call, as the loops do); the others through :func:`dtbench.decoders.kv.forward`
    with the curve's mask, position ids and last-only flag, built here, before the clock starts."""
    import torch

    from dtbench.decoders import kv

    key = (id(model), curve.prompt_len, curve.cache_len, curve.rows, curve.kind == "batched")
    if curve.kind == "batched":
        if curve.cache_len and key not in caches:
            caches[key] = kv.RaggedBatch(model)
            caches[key].prefill([_tokens(context, curve.cache_len)] * curve.rows)
        batch = caches.get(key)

        def batched(n: int) -> Forward:
            rows = [_tokens(context, n)] * curve.rows
            if batch is None:  # a prefill of B prompts into a fresh batch
                return (lambda: kv.RaggedBatch(model).prefill(rows)), (lambda: None)
            return (lambda: batch.forward(rows)), (lambda: batch.keep([[] for _ in range(curve.rows)]))

        return batched
    if curve.cache_len and key not in caches:
        caches[key] = kv.new_cache()
        kv.forward(model, _tokens(context, curve.cache_len), caches[key], last_only=True)
    cache = caches.get(key)

    def single(n: int) -> Forward:
        toks = torch.tensor([_tokens(context, n)], dtype=torch.long, device=model.device)
        kwargs: dict[str, Any] = {"last_only": curve.last_only}
        if curve.tree_mask:
            kwargs["position_ids"], kwargs["attention_mask"] = _tree_inputs(model, n, curve.cache_len)
        if cache is not None:
            return (lambda: kv.forward(model, toks, cache, **kwargs)), (lambda: kv.crop(cache, curve.cache_len))
        box = {"cache": kv.new_cache()}

        def fresh() -> None:
            box["cache"] = kv.new_cache()

        return (lambda: kv.forward(model, toks, box["cache"], **kwargs)), fresh

    return single


def measure_interleaved(
    models: dict[str, Any],
    curves: list[Curve],
    contexts: dict[int, list[int]],
    device,
    settings: Settings,
    clock: Callable[[], float] | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[Curve, list[tuple[int, float, float, int]]]:
    """Per curve, (n, median s, IQR s, repeats) of ONE forward per n (:func:`_forwards`: ``models[curve.role]``'s
    forward of the curve's kind on its cache, or B rows of it for a batched curve).

    Interleaved (issue 39 item 5): every (curve, n) point is visited in ``settings.passes`` passes, each pass in its
    own seeded random order; its first visit starts with ``settings.warmup`` untimed forwards, and each visit times
    its share of the point: at least ceil(``min_repeats`` / passes) forwards and ``min_time_s`` / passes seconds,
    stopped after ``max_time_s`` / passes seconds (at least one forward); a point's median is over all its visits.
    Measured one curve after another, a slow spell of the machine lands on one curve's points and skews every
    prediction that reads them (on a shared 2-core host a B = 1 one-token forward calibrated at 40 ms on 64 cached
    positions and 33 ms on 96 in one run); spread over passes in random order, it lands on scattered points of every
    curve. ``progress(pass)`` is called before each pass. Forwards are timed by the forward timer
    (:class:`~dtbench.harness.measurement.forwards.ForwardTimer` on ``device``, or on ``clock`` where given).
    """
    import random

    import torch

    from dtbench.harness.measurement.forwards import ForwardTimer, Latency

    timer = ForwardTimer(device, clock)
    order = random.Random(seed)
    times: dict[tuple[Curve, int], list[float]] = {(c, n): [] for c in curves for n in c.ns}
    rule = visit_rule(settings)
    with torch.inference_mode():
        caches: dict = {}
        forwards = {c: _forwards(models[c.role], c, contexts.get(c.prompt_len, []), caches) for c in curves}
        for p in range(max(1, settings.passes)):
            if progress is not None:
                progress(p)
            visits = list(times)
            order.shuffle(visits)
            for c, n in visits:
                once, reset = forwards[c](n)
                warmup = settings.warmup if p == 0 else 0  # a point's first visit only
                times[(c, n)] += timer.session(once, rule, reset=reset, warmup=warmup).times
    out: dict[Curve, list[tuple[int, float, float, int]]] = {}
    for c in curves:
        points = [(n, Latency(tuple(times[(c, n)]))) for n in c.ns]  # a point's statistics over all its visits
        out[c] = [(n, lat.median, lat.iqr, lat.repeats) for n, lat in points]
    return out


def calibrate(
    plan,
    suite,
    target,
    draft,
    device: torch.device,
    contexts: dict[int, list[int]],
    *,
    settings: Settings | None = None,
    clock: Callable[[], float] | None = None,
    console: Console | None = None,
) -> list[Point]:
    """Measure every curve the suite needs (:func:`curves_for`).

    Args:
        plan: the suite's :class:`~dtbench.harness.suites.plan.Plan`; suite: the :class:`~dtbench.harness.suites.suite.Suite`.
        target, draft: :class:`~dtbench.harness.models.loading.LoadedModel` (draft None: target only).
        contexts: prompt token ids per L_max, the cache's content (repeated to reach L_max + T).
        clock: a host clock in seconds to time forwards with (default: the forward timer's own source,
            :class:`~dtbench.harness.measurement.forwards.ForwardTimer`; tests inject a fake one).
    """
    settings = settings or Settings()
    loaded = {"target": target, "draft": draft}
    curves = []
    for curve in curves_for(plan, suite, draft is not None, settings.grown_cache):
        if curve.tree_mask and curve.kind != "batched":
            from dtbench.decoders.tree import attention_mask_kind

            try:
                attention_mask_kind(loaded[curve.role].model)
            except ValueError:
                continue  # this attention implementation runs no tree forwards: nothing to price
        curves.append(curve)
    passes = max(1, settings.passes)

    def progress(p: int) -> None:
        if console is not None:
            sizes = sorted({c.rows for c in curves if c.kind == "batched"})
            batched = f", batched verification at B = {', '.join(map(str, sizes))}" if sizes else ""
            console.print(
                f"calibrating {len(curves)} curves{batched} ({sum(len(c.ns) for c in curves)} points): "
                f"interleaved pass {p + 1}/{passes}",
                highlight=False,
            )

    models = {role: lm.model for role, lm in loaded.items() if lm is not None}
    measured = measure_interleaved(
        models, curves, contexts, device, settings, clock, seed=getattr(suite, "seed", 0) or 0, progress=progress
    )
    return [_point(curve, loaded[curve.role], *m) for curve in curves for m in measured[curve]]


def _point(curve: Curve, lm, n: int, med: float, iqr: float, reps: int) -> Point:
    """A measured point of ``curve`` on the loaded model ``lm``."""
    return Point(
        curve.role,
        lm.name,
        lm.dtype,
        curve.prompt_len,
        curve.cache_len,
        n,
        curve.tree_mask,
        curve.last_only,
        med,
        iqr,
        reps,
        curve.rows,
    )


def measure_on(worker, contexts: dict[int, list[int]], settings: Settings, console: Console | None = None) -> Measured:
    """:func:`calibrate` with a :class:`~dtbench.harness.execution.worker.Worker`'s plan, models and device, in the worker's
    process (the driver's, or a Ray actor's)."""
    points = calibrate(
        worker.plan,
        worker.suite,
        worker.target,
        worker.draft,
        worker.device,
        contexts,
        settings=settings,
        console=console,
    )
    info = worker.info
    return Measured(points, info.host, info.pid, str(worker.device), info.device_name)
