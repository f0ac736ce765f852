"""The tuning line: which setting of a decoder compared in several settings was fastest (e.g.
``suites/dynatree-tuning.yaml``).

The paper tunes rho_stop and rho_deep "on a held-out set" (section 3.3) and leaves W, a*, eta_D, eta_h and B_mid
open; dtbench's tuning suite sweeps them on held-out WikiText-2 articles. This module reads a run from the
database only (like every report) and, for the decoder measured in the most settings side by side (any decoder,
built-in or plugin, but the baseline; one workload, one way of decoding), names the cell with the highest speedup,
with the params that differ from that decoder's defaults (its own ``Params`` model, looked up in the decoder
registry), so a reader can copy them.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from dtbench.reports.stats import BASELINE, pairing_key
from dtbench.reports.views.summary import get_run, lossless_failed, samples_frame, summarize


def default_params(decoder: str) -> dict:
    """The decoder's params with every default (``Params()``), or {} when it is not installed or has required
    params (then every stored param counts as changed).

    The one place a report reads the plugin registry (reports otherwise read the database only): the defaults of an
    installed decoder are not stored with a run, and the Tuning line names the params a best setting changed."""
    from dtbench.harness import registry
    from dtbench.harness.errors import DtbenchError

    try:
        return registry.validate_params(decoder, {}).model_dump(mode="json")
    except DtbenchError:
        return {}


def best_setting(summary: pd.DataFrame) -> dict | None:
    """The fastest setting of the decoder compared in the most settings side by side in a run summary
    (:func:`~dtbench.reports.views.summary.summarize`; ties: the comparison listed first).

    Settings are compared only side by side: cells of one decoder in one group (dataset, L_max, T) that decode the
    same way (:func:`~dtbench.reports.stats.pairing_key`: greedy with greedy, one sampling setting with itself) and
    differ in their params. Cells that differ only in how they decode (``suites/sampling.yaml``: linear K=4 greedy,
    T=0.7, T=1.0) or only in their workload are not settings to choose between. Speedup (mean throughput after
    warmup / the same group's AR mean, decoding the same way) ranks them.

    Returns:
        None when no decoder has two settings with different params side by side, else {"decoder", "label",
        "dataset", "l_max", "gen_length", "n" (prompts after warmup), "speedup", "tokens_per_iteration", "changed"
        (params differing from the defaults, name -> value), "defaults_speedup" (speedup of a cell with default
        params, NaN if none), "runner_up" (label, speedup), "cells" (cells of that decoder compared)}.
    """
    if summary.empty:
        return None
    lossy = summary.apply(lossless_failed, axis=1).astype(bool)  # never ranked, never the best setting
    measured = summary[(summary["decoder"] != BASELINE) & summary["speedup"].notna() & (summary["n"] > 0) & ~lossy]
    if measured.empty:
        return None
    keys = list(zip(measured["decoder"], pairing_key(measured)))  # (decoder, the cells' pairing key)
    comparisons: dict[tuple[str, tuple], list] = {}
    for key, (i, params) in zip(keys, measured["params"].items()):
        comparisons.setdefault(key, []).append((i, json.dumps(params or {}, sort_keys=True, default=str)))
    settings = {k: v for k, v in comparisons.items() if len({p for _, p in v}) >= 2}
    if not settings:
        return None
    key = max(settings, key=lambda k: len(settings[k]))  # max keeps the first of equals: the first listed
    cells = measured.loc[[i for i, _ in settings[key]]]
    decoder, _ = key
    ranked = cells.sort_values("speedup", ascending=False, kind="stable")
    best, second = ranked.iloc[0], ranked.iloc[1]
    defaults = default_params(decoder)
    changed = {k: v for k, v in (best["params"] or {}).items() if defaults.get(k, object()) != v}
    plain = [
        s
        for s, p in zip(cells["speedup"], cells["params"])
        if defaults and all(defaults.get(k, object()) == v for k, v in (p or {}).items())
    ]
    return {
        "decoder": decoder,
        "label": best["label"],
        "dataset": best["dataset"],
        "l_max": int(best["l_max"]),
        "gen_length": int(best["gen_length"]),
        "n": int(best["n"]),
        "speedup": float(best["speedup"]),
        "tokens_per_iteration": float(best["tokens_per_iteration"]),
        "changed": changed,
        "defaults_speedup": float(plain[0]) if plain else math.nan,
        "runner_up": (second["label"], float(second["speedup"])),
        "cells": len(cells),
    }


def tuning_line(best: dict) -> str:
    """One line naming the best setting (for the report's stderr notes)."""
    changed = ", ".join(f"{k}={v}" for k, v in best["changed"].items()) or "none (the defaults)"
    defaults = "" if math.isnan(best["defaults_speedup"]) else f"; defaults {best['defaults_speedup']:.2f}x"
    name = best["decoder"]
    return (
        f"{name} tuning: best setting {best['label']!r} — speedup {best['speedup']:.2f}x, "
        f"L {best['tokens_per_iteration']:.2f} ({best['dataset']}, L_max={best['l_max']}, "
        f"T={best['gen_length']}, {best['n']} prompts after warmup, {best['cells']} {name} settings{defaults}; "
        f"runner-up {best['runner_up'][0]!r} {best['runner_up'][1]:.2f}x); params changed from the defaults: "
        f"{changed}"
    )


def print_tuning_line(sessions, run_id: int | None, echo) -> None:
    """Echo :func:`tuning_line` for the run (the latest if None) when it compares several settings of a decoder."""
    with sessions() as session:
        run = get_run(session, run_id)
        summary = summarize(samples_frame(session, run.id))
    best = best_setting(summary)
    if best is not None:
        echo(tuning_line(best))
