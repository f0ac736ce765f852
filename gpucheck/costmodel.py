"""Step c, **cost model**: the calibration at the paper's shapes and caps, and the speedups its curves predict from
the paper's own Table 3 beside Table 1 (:func:`step_costmodel`; the package docstring)."""

from __future__ import annotations

import math
from typing import Any

from dtbench.gpucheck.common import PAPER, T_PAPER, PaperRow, paper_tables


def tree_node_bounds(depth: int, branching: int, tau: float) -> tuple[int, int]:
    """(fewest, most) drafted nodes of a tree of ``depth`` levels, ``branching`` children per expanded node and leaf
    pruning at path probability ``tau`` (paper 3.3; dtbench's ``prune: leaf``): at least one node per level; at most
    ``min(B^d, B * floor(1 / tau))`` at level d, since at most ``1/tau`` nodes of a level have path probability
    >= tau (their probabilities sum to at most 1) and only those are expanded."""
    most = sum(min(branching**d, branching * math.floor(1 / tau)) for d in range(1, depth + 1))
    return depth, most


def level_sizes(n: int, depth: int) -> list[int]:
    """n drafted nodes spread over ``depth`` levels as evenly as possible (the draft's per-level forwards)."""
    return [n // depth + (1 if i < n % depth else 0) for i in range(depth) if n // depth + (i < n % depth)]


def predict(curves, row: PaperRow, nodes: int | None = None) -> dict:
    """Predicted speedup of ``row``'s method over AR at T = 1500 from the calibrated curves and Table 3's
    iterations, and the AR and method seconds it rests on.

    AR: a prefill of L_max tokens, then T target forwards of one token. A chain of K: per iteration K draft forwards
    of one token (``last`` kind) and one target verification of K + 1 tokens (causal). A tree of ``nodes`` drafted
    nodes and depth D: per iteration D draft forwards (tree mask) over the nodes of each level and one target
    verification of 1 + ``nodes`` tokens (tree mask). The cache is priced at its mean length, L_max + T/2 (linear
    in between the calibrated L_max and L_max + T).
    """
    from dtbench.harness.calibration.curves import FED_LAST, FED_MASK
    from dtbench.reports.pricing.pricing import Pricer

    pricer = Pricer(curves)
    past = row.l_max + T_PAPER // 2
    ar = pricer.target_cost(row.l_max, 0) + T_PAPER * pricer.target_cost(1, past)
    prefill = pricer.target_cost(row.l_max, 0) + pricer.draft_prefill(row.l_max)
    if row.k is not None:
        draft = row.k * pricer.forward_cost("draft", 1, past, FED_LAST)
        verify = pricer.verify_cost(row.k + 1, past, 1, "chain")
    else:
        assert nodes is not None and row.depth is not None
        draft = sum(pricer.forward_cost("draft", s, past, FED_MASK) for s in level_sizes(nodes, row.depth))
        verify = pricer.verify_cost(1 + nodes, past, 1, "tree")
    method = prefill + row.iterations * (draft + verify)
    return {
        "ar_s": ar,
        "method_s": method,
        "draft_s_per_iter": draft,
        "verify_s_per_iter": verify,
        "speedup": ar / method,
    }


def _curves_to_measure(l_maxes: tuple[int, ...], T: int, ns: tuple[int, ...]) -> list:
    """The calibration curves of step c: per prompt cap, the target's causal and tree verification and the draft's
    last-only and tree forwards on caches of L_max and L_max + T positions (one cache length serves every cap that
    reaches it), and both models' prefill of L_max tokens."""
    from dtbench.harness.calibration.calibrate import THIN, Curve

    curves_spec, seen = [], set()
    for l_max in l_maxes:
        for cache in (l_max, l_max + T):
            for c in (
                Curve("target", "causal", cache, l_max, ns),
                Curve("target", "tree", cache, l_max, ns),
                Curve("draft", "last", cache, l_max, THIN),
                Curve("draft", "tree", cache, l_max, THIN),
            ):
                if (c.role, c.kind, c.cache_len) not in seen:
                    seen.add((c.role, c.kind, c.cache_len))
                    curves_spec.append(c)
        curves_spec += [Curve("target", "prefill", 0, l_max, (l_max,)), Curve("draft", "prefill", 0, l_max, (l_max,))]
    return curves_spec


def _prediction(curves, row: PaperRow) -> dict[str, Any]:
    """The JSON row of one paper row's prediction: a chain's speedup, or a tree's range over its node bounds
    (:func:`tree_node_bounds`) and the node count the paper's speedup implies."""
    p: dict[str, Any] = {
        "method": row.method,
        "dataset": row.dataset,
        "l_max": row.l_max,
        "paper_speedup": row.speedup,
        "paper_cite": row.cite,
        "tokens_per_iter": row.tokens_per_iter,
        "iterations": row.iterations,
    }
    if row.k is not None:
        p.update(k=row.k, predicted=predict(curves, row))
        p["predicted_speedup"] = p["predicted"]["speedup"]
        return p
    assert row.depth is not None and row.branching is not None and row.tau is not None  # a tree row of PAPER
    lo, hi = tree_node_bounds(row.depth, row.branching, row.tau)
    grid = {n: predict(curves, row, n)["speedup"] for n in range(lo, hi + 1)}
    implied = min(grid, key=lambda n: abs(grid[n] - row.speedup))
    p.update(
        depth=row.depth,
        branching=row.branching,
        tau=row.tau,
        nodes_range=[lo, hi],
        predicted_speedup_range=[grid[hi], grid[lo]],
        predicted_at_fewest=predict(curves, row, lo),
        predicted_at_most=predict(curves, row, hi),
        nodes_implied_by_paper=implied,
        paper_inside_range=grid[hi] <= row.speedup <= grid[lo],
    )
    return p


def step_costmodel(device, target, draft, small: bool, log) -> dict:
    """Calibrate the target and draft at the paper's prompt caps and predict Table 1's speedups (step c; small
    shapes: the same arithmetic on toy curves, exercised, not meaningful). Forwards are timed by the forward timer
    (:class:`~dtbench.harness.measurement.forwards.ForwardTimer`: CUDA events on a GPU)."""
    from dtbench.harness.calibration.calibrate import Settings, measure_curve, n_grid
    from dtbench.harness.calibration.curves import Curves
    from dtbench.reports.pricing.pricing import Pricer

    settings = (  # small shapes: the arithmetic exercised on toy curves, so the fewest repeats that still time each n
        Settings(min_repeats=3, min_time_s=0.0, max_time_s=0.05, warmup=1, rel_tol=0.5)
        if small
        else Settings(min_repeats=5, min_time_s=0.05, max_time_s=0.4, warmup=2, rel_tol=0.05)
    )
    l_maxes = (24, 40) if small else (800, 1000)
    T = 16 if small else T_PAPER
    ns = tuple(n_grid(64 if small else 256))
    vocab = target.config.vocab_size
    context = [3 + (i * 7919) % (vocab - 3) for i in range(max(l_maxes) + T)]
    rows: list[dict[str, Any]] = []
    for c in _curves_to_measure(l_maxes, T, ns):
        model = target if c.role == "target" else draft
        for n, med, iqr, reps in measure_curve(model, c, context, device, settings):
            rows.append(
                {
                    "role": c.role,
                    "kind": c.kind,
                    "cache_len": c.cache_len,
                    "prompt_len": c.prompt_len,
                    "n": n,
                    "tree_mask": c.tree_mask,
                    "last_only": c.last_only,
                    "median_s": med,
                    "iqr_s": iqr,
                    "repeats": reps,
                }
            )
        log(f"calibrated {c.role} {c.kind} cache {c.cache_len}: n {c.ns[0]}..{c.ns[-1]}")

    class _Row:  # Curves reads attributes
        def __init__(self, d):
            self.__dict__.update(d)

    curves = Curves([_Row(r) for r in rows])
    predictions = []
    for row in PAPER:
        predictions.append(_prediction(curves, row))
        shown = predictions[-1].get("predicted_speedup", predictions[-1].get("predicted_speedup_range"))
        log(f"predicted {row.method} {row.dataset}: {shown} (paper {row.speedup})")
    ar_tpot = {l_max: Pricer(curves).target_cost(1, l_max + T // 2) for l_max in l_maxes}
    return {  # "seconds": the step's, added by the command
        "ok": bool(rows) and all(r["median_s"] > 0 for r in rows),
        "caps": list(l_maxes),
        "T": T,
        "ns": list(ns),
        "settings": settings.__dict__,
        "ar_step_s_at_mean_cache": {str(k): v for k, v in ar_tpot.items()},
        "paper_ar_tpot_s": dict(paper_tables()["ar_tpot_s"]),
        "points": rows,
        "predictions": predictions,
    }
