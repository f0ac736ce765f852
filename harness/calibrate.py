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
- ``prefill``: the prompt (``cache_len = 0``, last position's logits only).

``n`` runs over a grid (every n up to 16, then 24, 32, 48, 64, 96, ... up to the largest tree or chain the suite's
decoders can build); ``cache_len`` over the suite's prompt lengths L_max and L_max + max(T) (the cache grows while
decoding; the cost model interpolates between the two). Each point is timed device-synchronized, after warmup
forwards, repeated until at least ``min_repeats`` forwards AND ``min_time_s`` seconds have passed and the median
of all repeats is within ``rel_tol`` of the median of the first half (stable), or ``max_time_s`` passed
(optimum-benchmark's min-count-and-min-duration rule plus a stability check). The mask, position ids and tokens
are built before the clock starts: what is timed is the model forward alone, so decoder overhead (mask building,
cache copies, host syncs) shows up in the cost model's efficiency, not in its prediction.

Storage (table ``calibrations``, :class:`dtbench.harness.db.Calibration`): one row per point, all rows of one
calibration sharing ``batch``. A suite's calibration has ``run_id`` = its run; a standalone calibration has
``run_id`` NULL and no ``runs`` row (a runs row without cells would become "the latest run" of ``dtbench report``);
the cost model matches it to a run by target/draft model, dtype, device and device name.

``n_max: auto`` (tree decoders, an extension of the paper's fixed N_max = 256): the runner resolves it before the
first cell from the calibrated target tree-verify curve at the decoder's first prompt length — the largest
calibrated n whose verify cost (root + n drafted nodes) is at most ``n_max_factor`` x the cost of one AR token
(see :func:`auto_budget`).
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click
from rich.console import Console

from dtbench.harness.errors import DtbenchError

if TYPE_CHECKING:  # torch is imported lazily, so `dtbench --help` stays fast
    import torch

# torch, numpy and the measurement module are imported where used: `dtbench --help` stays fast.
FED_MASK, FED_LAST = 1, 2  # = dtbench.harness.measure.FED_MASK / FED_LAST (tests check they agree)

SMALL = 16  # every n up to here is calibrated (CPU kernels make the curve non-monotonic at small n)
LARGE = (24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
THIN = (1, 2, 3, 4, 6, 8, 12, 16)  # the grid of the kinds only small forwards use (drafting, rebuild re-runs)
AUTO_SEARCH_MAX = 256  # n_max: auto searches budgets up to this many drafted nodes (the paper's N_max)
DEFAULT_FACTOR = 2.0
KINDS = {"causal": (False, False), "tree": (True, False), "last": (False, True)}  # kind -> (tree_mask, last_only)


def n_grid(n_max: int) -> list[int]:
    """The calibrated n: 1..min(16, n_max), then :data:`LARGE` values below n_max, then n_max itself."""
    n_max = max(1, int(n_max))
    return sorted({*range(1, min(SMALL, n_max) + 1), *(n for n in LARGE if n < n_max), n_max})


@dataclass
class Settings:
    """When one point's timing stops (see the module docstring)."""

    min_repeats: int = 5
    min_time_s: float = 0.1
    max_time_s: float = 1.0
    rel_tol: float = 0.05
    warmup: int = 1
    grown_cache: bool = True  # also calibrate on L_max + max(T) cached positions (else L_max only)


@dataclass(frozen=True)
class Curve:
    """One curve to measure: a role's forwards of one kind on one cache length, over ``ns``."""

    role: str
    kind: str  # causal | tree | last | prefill
    cache_len: int
    prompt_len: int
    ns: tuple[int, ...]

    @property
    def tree_mask(self) -> bool:
        return self.kind == "tree"

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


# --- what to calibrate ------------------------------------------------------------------------------------------


def _tree_size(p: dict) -> int:
    """Largest verification (root + drafted nodes) a tree decoder's params allow."""
    from dtbench.decoders.tree import tree_capacity

    n_max = p.get("n_max")
    n_max = AUTO_SEARCH_MAX if n_max == "auto" or n_max is None else int(n_max)
    breadth = max(int(p.get("b_max") or 0), int(p.get("branching") or 0), 1)
    depth = max(int(p.get("d_max") or 0), int(p.get("depth") or 0), int(p.get("d0") or 0), 1)
    return tree_capacity(breadth, depth, n_max)


def decoder_sizes(plan) -> tuple[int, int]:
    """(largest chain verification, largest masked verification) the plan's decoders can run (tokens incl. the
    pending one); the second is 0 when no decoder passes a 4D mask (trees; StreamingLLM's masked forwards)."""
    chain, tree = 1, 0
    for cp in plan.decoders:
        p = cp.params.model_dump()
        if "n_max" in p:
            tree = max(tree, _tree_size(p))
        elif "k" in p:
            chain = max(chain, int(p["k"]) + 1)
            if "window" in p:  # StreamingLLM verifies with a 4D mask: priced on the tree curve
                tree = max(tree, int(p["k"]) + 1)
        elif "window" in p:
            tree = max(tree, 1)
        elif "num_assistant_tokens" in p:  # transformers' heuristic schedule grows it by 2 per full acceptance
            chain = max(chain, min(2 * int(p["num_assistant_tokens"]) + 1, 64))
    return chain, tree


def curves_for(plan, suite, uses_draft: bool, grown_cache: bool = True) -> list[Curve]:
    """The curves a suite needs: per role, kind and cache length (module docstring)."""
    chain, tree = decoder_sizes(plan)
    caps = sorted({c for ds in suite.datasets for c in ds.caps})
    T = max(suite.generation_lengths)
    out: list[Curve] = []
    roles = ["target", *(["draft"] if uses_draft else [])]
    for cap in caps:
        for role in roles:
            for cache_len in sorted({cap, cap + T} if grown_cache else {cap}):
                if role == "target":
                    out.append(Curve(role, "causal", cache_len, cap, tuple(n_grid(max(chain, SMALL)))))
                else:
                    out.append(Curve(role, "causal", cache_len, cap, THIN))
                if tree:
                    out.append(Curve(role, "tree", cache_len, cap, tuple(n_grid(max(tree, 8)))))
                out.append(Curve(role, "last", cache_len, cap, THIN))
            out.append(Curve(role, "prefill", 0, cap, tuple(sorted({max(1, cap // 2), cap}))))
    return out


# --- measuring ---------------------------------------------------------------------------------------------------


def _iqr(xs: list[float]) -> float:
    import numpy as np

    if len(xs) < 2:
        return 0.0
    q = np.percentile(xs, [25, 75])
    return float(q[1] - q[0])


def time_point(run_once: Callable[[], None], reset: Callable[[], None], device: torch.device, settings: Settings,
               clock: Callable[[], float]) -> tuple[float, float, int]:
    """(median s, IQR s, repeats) of ``run_once`` timed device-synchronized; ``reset`` (untimed) after each call."""
    from dtbench.harness import measure

    for _ in range(settings.warmup):
        run_once()
        reset()
    times: list[float] = []
    begin = clock()
    while True:
        measure.synchronize(device)
        t0 = clock()
        run_once()
        measure.synchronize(device)
        times.append(clock() - t0)
        reset()
        elapsed = clock() - begin
        if elapsed >= settings.max_time_s and len(times) >= 3:
            break
        if len(times) >= settings.min_repeats and elapsed >= settings.min_time_s:
            med, first = statistics.median(times), statistics.median(times[: max(1, len(times) // 2)])
            if med == 0 or abs(med - first) <= settings.rel_tol * med:
                break
    return statistics.median(times), _iqr(times), len(times)


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


def measure_curve(model: torch.nn.Module, curve: Curve, context: list[int], device: torch.device, settings: Settings,
                  clock: Callable[[], float]) -> list[tuple[int, float, float, int]]:
    """(n, median s, IQR s, repeats) of each n of ``curve`` with ``model``.

    Raises:
        ValueError: a tree curve for a model whose attention implementation cannot take a tree mask.
    """
    import torch

    with torch.inference_mode():
        return _measure_curve(model, curve, context, device, settings, clock)


def _measure_curve(model, curve: Curve, context: list[int], device, settings: Settings,
                   clock: Callable[[], float]) -> list[tuple[int, float, float, int]]:
    import torch

    from dtbench.decoders import kv

    out = []
    cache = None
    if curve.cache_len:
        cache = kv.new_cache()
        kv.forward(model, _tokens(context, curve.cache_len), cache, last_only=True)
    for n in curve.ns:
        toks = torch.tensor([_tokens(context, n)], dtype=torch.long, device=model.device)
        kwargs = {"last_only": curve.last_only}
        if curve.tree_mask:
            kwargs["position_ids"], kwargs["attention_mask"] = _tree_inputs(model, n, curve.cache_len)
        if curve.cache_len:
            def run_once(toks=toks, kwargs=kwargs):
                kv.forward(model, toks, cache, **kwargs)

            def reset():
                kv.crop(cache, curve.cache_len)
        else:
            box = {}

            def run_once(toks=toks, kwargs=kwargs, box=box):
                kv.forward(model, toks, box["cache"], **kwargs)

            def reset(box=box):
                box["cache"] = kv.new_cache()

            reset()
        med, iqr, reps = time_point(run_once, reset, device, settings, clock)
        out.append((n, med, iqr, reps))
    return out


def calibrate(plan, suite, target, draft, device: torch.device, contexts: dict[int, list[int]], *,
              settings: Settings | None = None, clock: Callable[[], float] | None = None,
              console: Console | None = None) -> list[Point]:
    """Measure every curve the suite needs (:func:`curves_for`).

    Args:
        plan: the suite's :class:`~dtbench.harness.plan.Plan`; suite: the :class:`~dtbench.harness.suite.Suite`.
        target, draft: :class:`~dtbench.harness.models.LoadedModel` (draft None: target only).
        contexts: prompt token ids per L_max, the cache's content (repeated to reach L_max + T).
        clock: seconds (default :func:`dtbench.harness.measure.now`; tests inject a fake one).
    """
    from dtbench.harness import measure

    settings = settings or Settings()
    clock = clock or (lambda: measure.now())
    loaded = {"target": target, "draft": draft}
    points: list[Point] = []
    curves = curves_for(plan, suite, draft is not None, settings.grown_cache)
    for i, curve in enumerate(curves):
        lm = loaded[curve.role]
        if curve.tree_mask:
            from dtbench.decoders.tree import attention_mask_kind

            try:
                attention_mask_kind(lm.model)
            except ValueError:
                continue  # this attention implementation runs no tree forwards: nothing to price
        if console is not None:
            console.print(f"calibrating {curve.role} {curve.kind} on {curve.cache_len} cached tokens "
                          f"(n = {curve.ns[0]}..{curve.ns[-1]}, curve {i + 1}/{len(curves)})", highlight=False)
        for n, med, iqr, reps in measure_curve(lm.model, curve, contexts.get(curve.prompt_len, []), device, settings,
                                               clock):
            points.append(Point(curve.role, lm.name, lm.dtype, curve.prompt_len, curve.cache_len, n, curve.tree_mask,
                                curve.last_only, med, iqr, reps))
    return points


def store(sessions, points: list[Point], *, run_id: int | None, suite_name: str, suite_hash: str,
          device: torch.device) -> str:
    """Write ``points`` as one calibration batch; return the batch id."""
    from dtbench.harness import measure
    from dtbench.harness.db import Calibration

    batch = uuid.uuid4().hex
    dev_name = measure.device_name(device)
    with sessions() as session:
        for p in points:
            session.add(Calibration(run_id=run_id, batch=batch, suite_name=suite_name, suite_hash=suite_hash,
                                    device=str(device), device_name=dev_name, **p.__dict__))
        session.commit()
    return batch


# --- reading: the curves as a cost function ------------------------------------------------------------------------


@dataclass
class Curves:
    """Calibrated forward costs: ``cost(role, n, past, flags)`` in seconds (the cost model's price list).

    A forward with ``past == 0`` is a prefill (its n on the prefill curve); any other is priced on the curve of its
    kind (flags: ``FED_MASK`` -> tree, ``FED_LAST`` -> last, else causal; a kind not calibrated falls back to causal,
    then to any), linearly interpolated in n between calibrated points (outside them: extended along the nearest
    end segment) and in the cache length between calibrated cache lengths
    (clamped outside them; ``past`` None: the shortest).
    """

    rows: list = field(default_factory=list)  # objects with role, cache_len, n, tree_mask, last_only, median_s
    batch: str | None = None
    run_id: int | None = None

    def __post_init__(self):
        import numpy as np

        table: dict[tuple[str, str], dict[int, list[tuple[int, float]]]] = {}
        for r in self.rows:
            kind = "prefill" if r.cache_len == 0 else "tree" if r.tree_mask else "last" if r.last_only else "causal"
            table.setdefault((r.role, kind), {}).setdefault(int(r.cache_len), []).append((int(r.n), float(r.median_s)))
        def curve(pts):  # the same n measured twice (it should not be): their mean
            by_n: dict[int, list[float]] = {}
            for n, sec in pts:
                by_n.setdefault(n, []).append(sec)
            ns = sorted(by_n)
            return np.array(ns, dtype=float), np.array([sum(by_n[n]) / len(by_n[n]) for n in ns], dtype=float)

        self._table = {k: {c: curve(v) for c, v in per.items()} for k, per in table.items()}

    def roles(self) -> set[str]:
        return {role for role, _ in self._table}

    def has(self, role: str, kind: str) -> bool:
        return (role, kind) in self._table

    def points(self, role: str, kind: str, cache_len: int | None = None):
        """(n, median s) of one curve; ``cache_len`` None: the shortest cache length calibrated."""
        per = self._table[(role, kind)]
        c = min(per) if cache_len is None else cache_len
        return per[c]

    @staticmethod
    def _interp(ns, secs, n: float) -> float:
        import numpy as np

        if len(ns) == 1:
            return float(secs[0] * n / ns[0])
        if ns[0] <= n <= ns[-1]:
            return float(np.interp(n, ns, secs))
        i = 0 if n < ns[0] else len(ns) - 2  # outside: along the nearest end segment (never below 0)
        slope = (secs[i + 1] - secs[i]) / (ns[i + 1] - ns[i])
        return max(0.0, float(secs[i] + slope * (n - ns[i])))

    def kind_of(self, role: str, past: int | None, flags: int) -> str:
        if past == 0 and self.has(role, "prefill"):
            return "prefill"
        want = "tree" if flags & FED_MASK else "last" if flags & FED_LAST else "causal"
        for kind in (want, "causal", "tree", "last"):
            if self.has(role, kind):
                return kind
        raise KeyError(f"no calibration for the {role}")

    def cost(self, role: str, n: int, past: int | None, flags: int = 0) -> float:
        """Seconds of one forward of ``role`` over ``n`` new tokens after ``past`` cached positions.

        Raises:
            KeyError: the role has no calibration at all.
        """
        if (role, "prefill") not in self._table and not any(r == role for r, _ in self._table):
            raise KeyError(f"no calibration for the {role}")
        kind = self.kind_of(role, past, flags)
        per = self._table[(role, kind)]
        lens = sorted(per)
        if kind == "prefill" or past is None or len(lens) == 1 or past <= lens[0]:
            return self._interp(*per[lens[0]], n)
        if past >= lens[-1]:
            return self._interp(*per[lens[-1]], n)
        hi = next(i for i, c in enumerate(lens) if c >= past)
        c0, c1 = lens[hi - 1], lens[hi]
        y0, y1 = self._interp(*per[c0], n), self._interp(*per[c1], n)
        return y0 + (y1 - y0) * (past - c0) / (c1 - c0)


def load_curves(session, run) -> Curves | None:
    """The calibration of ``run``: its own (newest batch linked to it), else the newest standalone calibration of
    the same target (model, dtype), device and device name (and draft, where both have one); None without any."""
    from sqlalchemy import select

    from dtbench.harness.db import Calibration

    rows = session.scalars(select(Calibration).where(Calibration.run_id == run.id)
                           .order_by(Calibration.id.desc())).all()
    if rows:
        batch = rows[0].batch
        return Curves([r for r in rows if r.batch == batch], batch=batch, run_id=run.id)
    env = run.environment or {}
    tgt, dft = env.get("target") or {}, env.get("draft") or {}
    cands = session.scalars(select(Calibration).where(
        Calibration.run_id.is_(None), Calibration.role == "target", Calibration.model == tgt.get("model"),
        Calibration.dtype == tgt.get("dtype"), Calibration.device == env.get("device"),
        Calibration.device_name == env.get("device_name")).order_by(Calibration.id.desc())).all()
    for cand in cands:
        batch_rows = session.scalars(select(Calibration).where(Calibration.batch == cand.batch)).all()
        drafts = [r for r in batch_rows if r.role == "draft"]
        if dft and drafts and (drafts[0].model, drafts[0].dtype) != (dft.get("model"), dft.get("dtype")):
            continue
        return Curves(batch_rows, batch=cand.batch, run_id=None)
    return None


# --- n_max: auto ---------------------------------------------------------------------------------------------------


def auto_budget(curves: Curves, cache_len: int, factor: float) -> int:
    """``n_max: auto``: the largest calibrated n (drafted nodes) whose tree verification — one target forward over
    the root and n nodes with the tree mask — costs at most ``factor`` x one AR step (one causal target forward
    over 1 token), on a cache of ``cache_len`` positions; at least 1, at most :data:`AUTO_SEARCH_MAX`.

    Only calibrated sizes are candidates (the curve need not be monotonic: on CPUs n = 2..3 can cost more than
    n = 4..8, so the largest n within the factor is taken, not the first n beyond it).
    """
    one = curves.cost("target", 1, cache_len, 0)
    kind = "tree" if curves.has("target", "tree") else "causal"
    per = curves._table[("target", kind)]
    ns, _ = per[min(per, key=lambda c: abs(c - cache_len))]
    best = 1
    for size in ns:
        n = int(size) - 1
        if 1 <= n <= AUTO_SEARCH_MAX and curves.cost("target", int(size), cache_len, FED_MASK) <= factor * one:
            best = max(best, n)
    return best


def _auto_cells(plan) -> list:
    return [cp for cp in plan.decoders if getattr(cp.params, "n_max", None) == "auto"]


def resolve_auto(plan, curves: Curves, console: Console | None = None) -> dict[str, int]:
    """Replace ``n_max: auto`` in the plan's decoders by :func:`auto_budget` at each decoder's first prompt length
    (one budget per decoder entry); return {label: n_max}."""
    out = {}
    for cp in _auto_cells(plan):
        cap = min(cap for _, cap, _ in cp.points) if cp.points else 0
        factor = float(getattr(cp.params, "n_max_factor", DEFAULT_FACTOR))
        n = auto_budget(curves, cap, factor)
        cp.params = cp.params.model_copy(update={"n_max": n})
        out[cp.label] = n
        if console is not None:
            console.print(f"n_max: auto -> {n} for {cp.label} (tree verify within {factor:g}x one token at "
                          f"L_max={cap})", highlight=False)
    return out


def contexts_of(prompts: dict[tuple[str, int], list]) -> dict[int, list[int]]:
    """Cache content per L_max: the first prompt of the first dataset with that cap."""
    out: dict[int, list[int]] = {}
    for (_, cap), ps in prompts.items():
        if ps and cap not in out:
            out[cap] = list(ps[0].token_ids)
    return out


def before_cells(sessions, run_id: int, plan, suite, suite_text: str, target, draft, device, prompts,
                 console: Console) -> Curves | None:
    """The runner's step before the first cell: calibrate when the suite asks (``calibrate: true``) or a decoder
    has ``n_max: auto`` — reusing the run's stored calibration on ``--resume`` — then resolve ``n_max: auto`` and
    record the chosen budgets in the cells' params."""
    from sqlalchemy import select

    from dtbench.harness.db import Calibration, Run
    from dtbench.harness.suite import suite_hash

    if not (suite.calibrate or _auto_cells(plan)):
        return None
    with sessions() as session:
        rows = session.scalars(select(Calibration).where(Calibration.run_id == run_id)).all()
        curves = Curves(rows, batch=rows[0].batch, run_id=run_id) if rows else None
    if curves is None:
        points = calibrate(plan, suite, target, draft, device, contexts_of(prompts), console=console)
        batch = store(sessions, points, run_id=run_id, suite_name=suite.name, suite_hash=suite_hash(suite_text),
                      device=device)
        curves = Curves(points, batch=batch, run_id=run_id)
        console.print(f"calibration stored: {len(points)} points (batch {batch[:8]})", highlight=False)
    budgets = resolve_auto(plan, curves, console)
    if budgets:
        with sessions() as session:
            for cell in session.get(Run, run_id).cells:
                if cell.label in budgets:
                    cell.params = {**(cell.params or {}), "n_max": budgets[cell.label]}
            session.commit()
    return curves


# --- the command ------------------------------------------------------------------------------------------------


@click.command("calibrate")
@click.argument("suite_path", type=click.Path(dir_okay=False))
@click.option("--db", "db_url", help="SQLAlchemy URL or SQLite file of the results database [env DTBENCH_DB; "
                                     "default sqlite:///results.db]")
@click.option("--data-dir", type=click.Path(file_okay=False), envvar="DTBENCH_DATA_DIR",
              help="local dataset folder (the cache is filled with the suite's first prompt) [env DTBENCH_DATA_DIR]")
@click.option("--min-time", type=click.FloatRange(0, min_open=True), default=Settings.min_time_s, show_default=True,
              help="seconds each point is timed at least")
@click.option("--max-time", type=click.FloatRange(0, min_open=True), default=Settings.max_time_s, show_default=True,
              help="seconds after which a point stops even if its median is not yet stable")
@click.option("--min-repeats", type=click.IntRange(1), default=Settings.min_repeats, show_default=True,
              help="forwards each point is timed at least")
@click.option("--prompt-cache-only", is_flag=True,
              help="calibrate on L_max cached positions only (default: also on L_max + T, interpolated between)")
def calibrate_command(suite_path, db_url, data_dir, min_time, max_time, min_repeats, prompt_cache_only) -> None:
    """Measure SUITE_PATH's target and draft forward-latency curves and store them (standalone, run_id NULL).

    One forward over n new tokens on a KV cache of the suite's prompt length (and prompt length + T), for
    n = 1 .. the largest tree or chain the suite's decoders build, with and without the tree mask, device-
    synchronized, repeated until the median is stable. `dtbench report --cost-model` uses the newest calibration
    of a run's models, dtype and device; `calibrate: true` in a suite does the same inside `dtbench run`.
    """
    from dtbench.harness import data, db, models
    from dtbench.harness.plan import plan_suite
    from dtbench.harness.suite import load_suite, suite_hash

    if max_time < min_time:
        raise DtbenchError(f"--max-time ({max_time:g}) must be at least --min-time ({min_time:g})")
    suite, text = load_suite(suite_path)
    plan = plan_suite(suite)
    sessions = db.connect(db_url)
    console = Console(stderr=True)
    device = models.resolve_device(suite.device)
    tokenizer = models.load_tokenizer(suite.target)
    prompts = {}
    for ds in suite.datasets:
        docs = data.load_documents(ds, data_dir)
        for cap in ds.caps:
            prompts[(ds.name, cap)] = data.select_prompts(docs, tokenizer, 1, cap, suite.seed)
    with console.status(f"loading target {suite.target.model} ({suite.target.dtype}) on {device}"):
        target = models.load_model(suite.target, device)
    draft = None
    if suite.draft is not None and any(p.cls.needs_draft for p in plan.decoders):
        with console.status(f"loading draft {suite.draft.model} ({suite.draft.dtype})"):
            draft = models.load_model(suite.draft, device)
    settings = Settings(min_repeats=min_repeats, min_time_s=min_time, max_time_s=max_time,
                        grown_cache=not prompt_cache_only)
    points = calibrate(plan, suite, target, draft, device, contexts_of(prompts), settings=settings, console=console)
    batch = store(sessions, points, run_id=None, suite_name=suite.name, suite_hash=suite_hash(text), device=device)
    console.print(f"stored {len(points)} calibration points (batch {batch}) in {db.resolve_url(db_url)}",
                  highlight=False)
    for line in summary_lines(Curves(points)):
        click.echo(line)


def summary_lines(curves: Curves) -> Iterable[str]:
    """One line per curve: role, kind, cache length and ms at each n."""
    for (role, kind), per in sorted(curves._table.items()):
        for c, (ns, secs) in sorted(per.items()):
            pts = " ".join(f"{int(n)}:{s * 1e3:.1f}" for n, s in zip(ns, secs))
            yield f"{role:6} {kind:7} cache {c:5}  n:ms  {pts}"
