"""The offline GPU check (issue 31): what a borrowed GPU node can verify in minutes, with no network and no model file.

``tools/gpu-check.sh OUT`` installs the kit (``make gpu-kit``) on the node and runs ``python -m dtbench.cli.gpucheck
--out OUT``; ``make gpu-check-dry`` runs the same on this CPU with ``--device cpu --small``. Every model is built on
the device from a fixed seed (no download, no embedded GGUF):

a. **lossless** (:func:`step_lossless`): every built-in lossless decoder (the parameter list
   :data:`dtbench.harness.testkit.BUILTIN`, which ``tests/test_measurement.py`` keeps complete) against ``ar`` on tiny
   Llama and GPT-NeoX pairs (:mod:`dtbench.harness.testkit`: target and a perturbed copy as the draft, sharp output
   layer). float32: the exact rule (token for token). float16 (bfloat16 on a CPU): the tie-aware rule of
   :mod:`dtbench.harness.lossless` (every emitted token is the target's argmax given the decoder's own prefix, up to
   the measured numeric noise).
b. **timing** (:func:`step_timing`): CUDA-event forward times (:class:`~dtbench.harness.measure.ForwardCounter`)
   against the wall clock around synchronized forwards of the Pythia-2.8B-shaped target; NVML's per-process peak
   against the allocator's peak (:class:`~dtbench.harness.memory.MemoryTracker`); energy per token of ``ar`` through
   Zeus (:mod:`dtbench.harness.energy`; "unavailable" with its reason where no counter can be read).
c. **cost model** (:func:`step_costmodel`): the calibration of :mod:`dtbench.harness.calibrate` for GPT-NeoX at
   Pythia-2.8B's and Pythia-70M's shapes (fp16, random weights): target verification latency (causal and tree mask)
   for 1..256 new tokens on caches of L_max and L_max + T positions, L_max = 800 (WikiText-2) and 1000 (PG-19),
   T = 1500 (paper Section 4.1), and the draft's per-token latency; then the speedups these curves predict from the
   paper's own Table 3 (tokens per iteration L-bar, iterations #Iter) for linear (K = 8 on WikiText-2, 5 on PG-19),
   the fixed tree (D = 8, B = 3, tau = 0.1) and DynaTree, beside the paper's Table 1 (:data:`PAPER`).
d. **loop overhead** (:func:`step_overhead`): each decoder at the same shapes, random weights (a random draft accepts
   almost nothing, so every iteration commits about one token): wall time minus the time inside model forwards,
   per iteration, against the paper's own time per iteration (T / throughput / #Iter).
e. **compiled** (:func:`step_compiled`, issue 37): the same shapes eager and compiled (static KV cache, bucketed
   ``torch.compile``, CUDA graphs on CUDA; :mod:`dtbench.decoders.kv`): one target forward's time for n = 1, 9, 64
   and 190 new tokens on a cache of L_max = 800 beside its memory-bandwidth limit (weights + attended KV over the
   copy-benchmark bandwidth, :mod:`dtbench.harness.roofline`), ``ar``'s tokens/s and roofline fraction both ways,
   and the loop overhead per iteration of ``linear`` and ``dynatree`` both ways; the compile time apart.

Output: ``OUT/gpu-check.json`` (:data:`SCHEMA`, validated by ``tests/test_gpucheck.py``) and ``OUT/gpu-check.log``.
Exit code 0 when every step passed, 1 when one failed (the JSON says which), 2 for bad arguments.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from dtbench.cli import gpu_budget


def _tests_dir() -> Path:
    """The repository's tests/ (the property tests the ``tests`` step runs; ``suites/`` beside it for ``smoke``):
    beside this file in a checkout, else under the working directory (tools/gpu-check.sh runs from the checkout with
    dtbench installed elsewhere)."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "tests" / "models.py").is_file():
            return root / "tests"
    raise click.ClickException("cannot find the repository's tests/ folder: run from the dtbench checkout")


SCHEMA = "dtbench.gpu-check/1"
STEPS = ("lossless", "timing", "costmodel", "overhead", "compiled", "tests", "smoke")

# Pythia's GPT-NeoX shapes (the paper's target and draft) and the --small pair: harness/models.py's table, which
# `random:<shape>` models of a suite use too (issue 38 item 4).
from dtbench.harness.random_models import RANDOM_SHAPES  # noqa: E402

PYTHIA_2_8B = RANDOM_SHAPES["pythia-2.8b"]
PYTHIA_70M = RANDOM_SHAPES["pythia-70m"]
SMALL_TARGET = RANDOM_SHAPES["tiny"]  # --small (the CPU dry run and the tests): the same architecture, a few MB
SMALL_DRAFT = RANDOM_SHAPES["tiny-draft"]


@dataclass(frozen=True)
class PaperRow:
    """One method of the paper's Tables 1 and 3 at T = 1500 (the DynaTree paper, docs/architecture.md "The paper"; Section 4.4).

    Attributes:
        speedup: Table 1's speedup over AR; throughput: Table 1's tokens/s; tokens_per_iter: Table 3's L-bar;
        iterations: Table 3's #Iter.; drafted: for a chain its K; for a tree (depth D, branching B, pruning tau)
        used to bound the drafted nodes per tree (:func:`tree_node_bounds`).
    """

    method: str
    dataset: str
    l_max: int
    speedup: float
    throughput: float
    tokens_per_iter: float
    iterations: int
    k: int | None = None
    depth: int | None = None
    branching: int | None = None
    tau: float | None = None
    cite: str = ""


T_PAPER = 1500
PAPER = (
    PaperRow("linear", "wikitext-2", 800, 1.47, 196.1, 6.82, 220, k=8, cite="Table 1 'Linear Spec' (K = 8); Table 3"),
    PaperRow(
        "fixed_tree",
        "wikitext-2",
        800,
        1.50,
        200.7,
        6.79,
        221,
        depth=8,
        branching=3,
        tau=0.1,
        cite="Table 1 'Fixed Tree (D = 8, B = 3, tau = 0.1)'; Table 3",
    ),
    PaperRow(
        "dynatree",
        "wikitext-2",
        800,
        1.64,
        219.5,
        7.08,
        212,
        depth=8,
        branching=3,
        tau=0.1,
        cite="Table 1 'DynaTree' (D_max = 8, B_max = 3, Appendix A); Table 3",
    ),
    PaperRow("linear", "pg19", 1000, 1.26, 144.9, 4.56, 329, k=5, cite="Table 1 'Linear Spec' (K = 5); Table 3"),
    PaperRow(
        "fixed_tree",
        "pg19",
        1000,
        1.62,
        185.5,
        6.20,
        242,
        depth=8,
        branching=3,
        tau=0.1,
        cite="Table 1 'Fixed Tree (D = 8, B = 3, tau = 0.1)'; Table 3",
    ),
    PaperRow(
        "dynatree",
        "pg19",
        1000,
        1.70,
        194.9,
        6.17,
        243,
        depth=8,
        branching=3,
        tau=0.1,
        cite="Table 1 'DynaTree'; Table 3",
    ),
)
AR_THROUGHPUT = {"wikitext-2": 133.4, "pg19": 114.8}  # Table 1, AR rows (tokens/s)
EVENT_REL_TOL, EVENT_ABS_TOL_S = 0.10, 0.5e-3  # CUDA events vs wall clock (as tests/test_cuda.py)
NVML_OVER_ALLOCATOR = 4 * 2**30  # NVML adds the CUDA context and the allocator's cache: well below this


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _sync(device) -> None:
    from dtbench.harness.memory import synchronize

    synchronize(device)


def neox(shape: dict, dtype, device, seed: int):
    """A GPT-NeoX causal LM of ``shape`` with seeded random weights on ``device`` in ``dtype``
    (:func:`dtbench.harness.random_models.random_neox`)."""
    from dtbench.harness.random_models import random_neox

    return random_neox(shape, dtype, device, seed)


# --- a. lossless ---------------------------------------------------------------------------------------------------


CRASH_ENV = "DTBENCH_GPUCHECK_CRASH"  # fault injection for the tests: a decoder name whose row segfaults the child


def _crash_if_asked(name: str) -> None:
    import os

    if os.environ.get(CRASH_ENV) == name:
        import ctypes

        ctypes.string_at(0)  # a real SIGSEGV in native code, as a crashing CUDA path gives


ONLY: set[str] | None = None  # --decoders: restrict steps a and d to these names (None: all)


def lossless_decoders() -> list[tuple[str, dict]]:
    """(name, params) of every built-in lossless decoder, as ``tests/test_measurement.py`` covers them
    (:data:`dtbench.harness.testkit.BUILTIN`; ``--decoders`` restricts them)."""
    from dtbench.harness import registry
    from dtbench.harness.testkit import BUILTIN

    return [(n, p) for n, p in BUILTIN if registry.get(n).lossless and (ONLY is None or n in ONLY)]


def build(name: str, params: dict, target, draft, workdir: Path):
    """``name``'s decoder on ``target``/``draft`` with ``params``; placeholder heads and datastores are written to
    ``workdir`` sized for the target (random weights in the published formats)."""
    import numpy as np

    from dtbench.harness import registry
    from dtbench.harness.testkit import HEAD, STORE, write_eagle, write_medusa

    cls = registry.get(name)
    if params.get("head") == HEAD:
        cfg = target.config
        write = write_medusa if name == "medusa" else write_eagle
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
        params = {**params, "head": str(write(folder, hidden=cfg.hidden_size, vocab=cfg.vocab_size))}
    if params.get("tokens") == STORE:
        path = Path(tempfile.mkdtemp(prefix="rest-", dir=workdir)) / "store.npy"
        vocab = target.config.vocab_size
        np.save(path, (np.arange(4096) * 7919 % (vocab - 3) + 3).astype(np.int64))
        params = {**params, "tokens": str(path)}
    return cls(target, draft if cls.needs_draft else None, cls.Params(**params))


def step_lossless(device, small: bool, workdir: Path, log, skip: frozenset = frozenset(), emit=None) -> dict:
    """Every built-in lossless decoder against ``ar`` on tiny Llama and GPT-NeoX pairs, float32 (exact rule) and
    float16 (tie-aware rule; bfloat16 on a CPU). Returns ``{"ok", "rows": [...]}``, one row per (arch, dtype,
    decoder): tokens, first divergence from ``ar``, the check's ties/errors/largest tie margin/noise, ok."""
    import torch

    from dtbench.harness.lossless import check_output
    from dtbench.harness.measure import measure
    from dtbench.harness.testkit import SHARP, perturbed, tiny_model
    from dtbench.harness.values import first_divergence

    T = 16 if small else 48
    prompt = list(range(3, 20))
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    rows = []
    archs = ("llama",) if small else ("llama", "neox")
    for arch in archs:
        base = tiny_model(arch, 0, sharpness=SHARP)
        base_draft = perturbed(base, 0.005, seed=1)
        for dtype in (torch.float32, half):
            target = copy.deepcopy(base).to(device=device, dtype=dtype)
            draft = copy.deepcopy(base_draft).to(device=device, dtype=dtype)
            ref = measure(build("ar", {}, target, None, workdir), prompt, T, device).tokens
            rule = "exact" if dtype == torch.float32 else "tie_aware"
            for i, (name, params) in enumerate(lossless_decoders()):
                rid = f"{arch}/{str(dtype).removeprefix('torch.')}/{i}"
                if rid in skip:
                    continue
                _crash_if_asked(name)
                row: dict[str, Any] = {
                    "id": rid,
                    "arch": arch,
                    "dtype": str(dtype).removeprefix("torch."),
                    "decoder": name,
                    "params": {k: v for k, v in params.items() if not str(v).startswith("<")},
                    "rule": rule,
                }
                try:
                    m = measure(build(name, params, target, draft, workdir), prompt, T, device)
                    check = check_output(target, prompt, m.tokens, ref, device)
                    div = first_divergence(m.tokens, ref)
                    ok = (div is None) if rule == "exact" else check.errors == 0
                    row.update(
                        tokens=len(m.tokens),
                        iterations=len(m.steps),
                        first_divergence=div,
                        ties=check.ties,
                        errors=check.errors,
                        max_tie_margin=check.max_tie_margin,
                        noise=check.max_noise,
                        ok=ok,
                    )
                except Exception as exc:  # a crashing decoder is a failed row, the check goes on
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(row)
                if emit:
                    emit(row)
                log(
                    f"lossless {arch} {row['dtype']} {name} {row['params']}: "
                    f"{'ok' if row['ok'] else 'FAIL'} {row.get('error', '')}"
                )
    return {"ok": all(r["ok"] for r in rows), "T": T, "prompt_tokens": len(prompt), "rows": rows}


# --- b. timing, memory, energy ---------------------------------------------------------------------------------------


def step_timing(device, target, log) -> dict:
    """CUDA events vs the wall clock, NVML vs the allocator, energy per token (module docstring, step b)."""
    import torch

    from dtbench.harness.energy import MEASURED
    from dtbench.harness.measure import ForwardCounter, measure
    from dtbench.harness.memory import MemoryTracker

    out: dict[str, Any] = {}
    vocab = target.config.vocab_size
    events = []
    with torch.inference_mode():
        for n in (1, 64, 512):
            ids = torch.randint(3, vocab, (1, n), device=device, generator=None)
            target(ids)  # warm the kernels of this shape
            for _ in range(3):
                with ForwardCounter(target, None) as counter:
                    _sync(device)
                    start = time.perf_counter()
                    target(ids)
                    _sync(device)
                    wall = time.perf_counter() - start
                ev = counter.forward_seconds()["target"]
                assert ev is not None  # the counter counts the target
                events.append(
                    {
                        "n": n,
                        "events_s": ev,
                        "wall_s": wall,
                        "ok": ev <= wall + EVENT_ABS_TOL_S and ev >= wall * (1 - EVENT_REL_TOL) - EVENT_ABS_TOL_S,
                    }
                )
    # On a CPU the "events" are the wall clock read inside the hooks: the comparison is shown, not judged (a loaded
    # CPU puts more than 10% of a 1 ms forward outside the hooks).
    out["forward_events_vs_wall"] = {
        "ok": all(e["ok"] for e in events) if device.type == "cuda" else True,
        "source": "cuda events"
        if device.type == "cuda"
        else "wall clock inside the hooks (CPU: informational, not judged)",
        "rel_tol": EVENT_REL_TOL,
        "abs_tol_s": EVENT_ABS_TOL_S,
        "rows": events,
    }
    size = 512 * 2**20 if device.type == "cuda" else 64 * 2**20
    with MemoryTracker(device) as mem:
        block = torch.empty(size, dtype=torch.uint8, device=device)
        block.fill_(1)
        _sync(device)
        time.sleep(0.1)  # NVML is polled every 5 ms
        del block
    peak = mem.peak
    if device.type == "cuda":
        ok = (
            peak.allocated_bytes is not None
            and peak.allocated_bytes >= size
            and peak.nvml_bytes is not None
            and peak.nvml_bytes >= peak.allocated_bytes
            and (peak.nvml_scope != "process" or peak.nvml_bytes - peak.allocated_bytes < NVML_OVER_ALLOCATOR)
        )
    else:
        ok = peak.rss_bytes is not None and peak.rss_bytes >= size
    out["memory"] = {
        "ok": bool(ok),
        "block_bytes": size,
        "allocated_bytes": peak.allocated_bytes,
        "nvml_bytes": peak.nvml_bytes,
        "nvml_scope": peak.nvml_scope,
        "rss_bytes": peak.rss_bytes,
    }
    T = 64
    prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = build("ar", {}, target, None, Path(tempfile.gettempdir()))
    measure(ar, prompt, 8, device)  # warmup
    m = measure(ar, prompt, T, device)
    e = m.energy
    energy = {
        "status": e.status if e else "unavailable",
        "source": e.source if e else "no reading",
        "energy_j": e.energy_j if e else None,
        "tokens": T,
        "j_per_token": (e.energy_j / T) if e is not None and e.status == MEASURED and e.energy_j else None,
        "seconds": m.step_times[-1],
    }
    # On a GPU the counter must be readable (NVML, Volta+); on a CPU an unreadable RAPL is normal, not a failure.
    energy["ok"] = energy["j_per_token"] is not None if device.type == "cuda" else True
    out["energy"] = energy
    out["ok"] = out["forward_events_vs_wall"]["ok"] and out["memory"]["ok"] and energy["ok"]
    log(
        f"timing: events {out['forward_events_vs_wall']['ok']}, memory {out['memory']['ok']}, "
        f"energy {energy['status']} {energy['j_per_token']}"
    )
    return out


# --- c. the cost model at the paper's shapes ---------------------------------------------------------------------


def tree_node_bounds(depth: int, branching: int, tau: float) -> tuple[int, int]:
    """(fewest, most) drafted nodes of a tree of ``depth`` levels, ``branching`` children per expanded node and leaf
    pruning at path probability ``tau`` (paper 3.3; dtbench's ``prune: leaf``): at least one node per level; at most
    ``min(B^d, B * floor(1 / tau))`` at level d, since at most ``1/tau`` nodes of a level have path probability
    >= tau (their probabilities sum to at most 1) and only those are expanded."""
    most = sum(min(branching**d, branching * math.floor(1 / tau)) for d in range(1, depth + 1))
    return depth, most


def _level_sizes(n: int, depth: int) -> list[int]:
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
    from dtbench.harness.curves import FED_LAST, FED_MASK

    past = row.l_max + T_PAPER // 2
    ar = curves.cost("target", row.l_max, 0) + T_PAPER * curves.cost("target", 1, past)
    prefill = curves.cost("target", row.l_max, 0) + curves.cost("draft", row.l_max, 0)
    if row.k is not None:
        draft = row.k * curves.cost("draft", 1, past, FED_LAST)
        verify = curves.cost("target", row.k + 1, past)
    else:
        assert nodes is not None and row.depth is not None
        draft = sum(curves.cost("draft", s, past, FED_MASK) for s in _level_sizes(nodes, row.depth))
        verify = curves.cost("target", 1 + nodes, past, FED_MASK)
    method = prefill + row.iterations * (draft + verify)
    return {
        "ar_s": ar,
        "method_s": method,
        "draft_s_per_iter": draft,
        "verify_s_per_iter": verify,
        "speedup": ar / method,
    }


def step_costmodel(device, target, draft, small: bool, log) -> dict:
    """Calibrate the target and draft at the paper's prompt caps and predict Table 1's speedups (step c)."""
    from dtbench.harness.calibrate import THIN, Curve, Settings, measure_curve, n_grid
    from dtbench.harness.curves import Curves

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
    curves_spec, seen = [], set()
    for l_max in l_maxes:
        for cache in (l_max, l_max + T):
            for c in (
                Curve("target", "causal", cache, l_max, ns),
                Curve("target", "tree", cache, l_max, ns),
                Curve("draft", "last", cache, l_max, THIN),
                Curve("draft", "tree", cache, l_max, THIN),
            ):
                if (c.role, c.kind, c.cache_len) not in seen:  # one cache length serves every cap that reaches it
                    seen.add((c.role, c.kind, c.cache_len))
                    curves_spec.append(c)
        curves_spec += [Curve("target", "prefill", 0, l_max, (l_max,)), Curve("draft", "prefill", 0, l_max, (l_max,))]
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    for c in curves_spec:
        model = target if c.role == "target" else draft
        for n, med, iqr, reps in measure_curve(model, c, context, device, settings, time.perf_counter):
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
    if True:  # small shapes: the same arithmetic on toy curves (exercised, not meaningful: "small" is set)
        for row in PAPER:
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
            else:  # a tree row of PAPER: depth, branching and tau given
                assert row.depth is not None and row.branching is not None and row.tau is not None
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
            predictions.append(p)
            log(
                f"predicted {row.method} {row.dataset}: {p.get('predicted_speedup', p.get('predicted_speedup_range'))}"
                f" (paper {row.speedup})"
            )
    ar_tpot = {l_max: curves.cost("target", 1, l_max + T // 2) for l_max in l_maxes}
    return {
        "ok": bool(rows) and all(r["median_s"] > 0 for r in rows),
        "seconds": time.perf_counter() - began,
        "caps": list(l_maxes),
        "T": T,
        "ns": list(ns),
        "settings": settings.__dict__,
        "ar_step_s_at_mean_cache": {str(k): v for k, v in ar_tpot.items()},
        "paper_ar_tpot_s": {"800": 7.48e-3, "1000": 9.00e-3},
        "points": rows,
        "predictions": predictions,
    }


# --- d. loop overhead -----------------------------------------------------------------------------------------------

OVERHEAD_DECODERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ar", {}),
    ("linear", {"k": 8}),
    ("fixed_tree", {"depth": 8, "branching": 3, "tau": 0.1}),
    ("dynatree", {}),
    ("ngram", {"k": 4}),
    ("suffix", {"k": 8}),
    ("token_recycling", {}),
    ("lookahead", {"window_size": 4, "ngram_size": 3, "guess_set_size": 4}),
    ("hf_generate", {}),
    ("hf_assisted", {}),
)


REPEATS = 3  # measurements per length in step d (medians)


def _totals(m) -> tuple[float, float, int]:
    """(wall seconds, seconds inside target + draft forwards, iterations) of one measurement."""
    fwd = m.forward_s or {}
    return m.step_times[-1], (fwd.get("target") or 0.0) + (fwd.get("draft") or 0.0), len(m.steps)


def _reads(decoder, prompt: list[int], T: int, device) -> dict[str, Any]:
    """Device-to-host reads and (on CUDA) the synchronizations CUDA reports, per iteration after the prefill's
    (issue 46 item 1, :func:`dtbench.harness.host_reads.reads_per_iteration`): the most in one iteration and the
    median."""
    from dtbench.harness.host_reads import reads_per_iteration

    counts = reads_per_iteration(decoder, prompt, T, device)
    out: dict[str, Any] = {}
    for key, per in counts.items():
        later = per[1:] or per
        out[f"{key}_per_iter_max"], out[f"{key}_per_iter_median"] = max(later), statistics.median(later)
    return out


def step_overhead(
    device, target, draft, small: bool, workdir: Path, log, skip: frozenset = frozenset(), emit=None
) -> dict:
    """Each decoder's time outside model forwards per iteration at the paper's shapes (step d).

    Differential, so the prefill cancels: the decoder runs to T0 and to T0 + T new tokens on the same prompt (random
    weights: the same iterations both times), :data:`REPEATS` times each (medians of wall and forward seconds), and
    overhead per iteration = (extra wall time - extra time inside forwards) / extra iterations. Forward times are CUDA events on a GPU (:class:`ForwardCounter`).
    """
    import torch

    from dtbench.harness.measure import measure

    vocab = target.config.vocab_size
    L, T0, T = (24, 2, 24) if small else (800, 8, 64)
    prompt = torch.randint(3, vocab, (L,), generator=torch.Generator().manual_seed(1)).tolist()
    paper_iter_s = {r.method: T_PAPER / r.throughput / r.iterations for r in PAPER if r.dataset == "wikitext-2"}
    paper_iter_s["ar"] = 1 / AR_THROUGHPUT["wikitext-2"]
    rows = []
    for i, (name, params) in enumerate(OVERHEAD_DECODERS):
        if (ONLY is not None and name not in ONLY) or str(i) in skip:
            continue
        _crash_if_asked(name)
        row: dict[str, Any] = {"id": str(i), "decoder": name, "params": params}
        try:
            measure(build(name, params, target, draft, workdir), prompt, T0, device)  # warmup

            def medians(length: int, name: str = name, params: dict = params):  # bound per decoder
                runs = [
                    measure(build(name, params, target, draft, workdir), prompt, length, device) for _ in range(REPEATS)
                ]
                totals = [_totals(m) for m in runs]
                return (
                    statistics.median(t[0] for t in totals),
                    statistics.median(t[1] for t in totals),
                    totals[0][2],
                    runs[-1],
                )

            w0, f0, i0, _ = medians(T0)
            w1, f1, i1, m = medians(T0 + T)
            iters = i1 - i0
            row.update(
                iterations=iters, tokens=T, wall_s=w1 - w0, forward_s=f1 - f0, forwards_timed=m.forward_s is not None
            )
            if iters > 0:
                loop = max(0.0, (w1 - w0) - (f1 - f0))
                row.update(
                    tokens_per_iter=T / iters,
                    overhead_s_per_iter=loop / iters,
                    forward_s_per_iter=(f1 - f0) / iters,
                    overhead_share=loop / max(w1 - w0, 1e-12),
                )
                if name in paper_iter_s:
                    row["paper_s_per_iter"] = paper_iter_s[name]
                    row["overhead_share_of_paper_iter"] = (loop / iters) / paper_iter_s[name]
            row.update(_reads(build(name, params, target, draft, workdir), prompt, T0 + 8, device))
            row["ok"] = iters > 0
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], trace=traceback.format_exc()[-800:])
        rows.append(row)
        if emit:
            emit(row)
        log(
            f"overhead {name}: {row.get('overhead_s_per_iter')} s/iter over {row.get('iterations')} iterations "
            f"{row.get('error', '')}"
        )
    return {"ok": all(r["ok"] for r in rows), "prompt_tokens": L, "T0": T0, "T": T, "rows": rows}


# --- e. compiled beside eager (issue 37) ------------------------------------------------------------------------

COMPILED_DECODERS: tuple[tuple[str, dict[str, Any]], ...] = (("linear", {"k": 8}), ("dynatree", {}))


def step_compiled(device, target, draft, small: bool, workdir: Path, log) -> dict:
    """Eager vs compiled execution at the paper's shapes (module docstring, step e). Medians of :data:`REPEATS`.

    Returns:
        {"ok", "compile_s", "graphs", "bandwidth", "forwards": [{n, eager_s, compiled_s, limit_s, eager_roofline,
        compiled_roofline}], "ar": {mode: {tokens_per_s, roofline}}, "overhead": [{decoder, mode,
        overhead_s_per_iter, forward_s_per_iter, overhead_share}]}.
    """
    from contextlib import nullcontext

    import torch

    from dtbench.decoders import kv, static_kv
    from dtbench.harness import roofline
    from dtbench.harness.measure import measure

    vocab = target.config.vocab_size
    L, T0, T = (24, 2, 16) if small else (800, 8, 64)
    ns = (1, 9, 16) if small else (1, 9, 64, 190)
    prompt = torch.randint(3, vocab, (L,), generator=torch.Generator().manual_seed(2)).tolist()
    bandwidth = roofline.measure_bandwidth(device)
    bw = bandwidth["bytes_per_s"]
    sizes = roofline.model_bytes(target)
    ex = static_kv.Execution(-(-(L + T0 + T + 2 * 256) // 64) * 64)
    start, graphs0 = time.perf_counter(), static_kv.compiled_graphs()
    ex.precompile([target], 0, sizes=ns)  # the forwards below and ar's; the decoders' other sizes compile in
    ex.precompile([draft], 0, sizes=(1, 2))  # their untimed warmup run (a whole precompile would pass the budget)
    compile_s, graphs = time.perf_counter() - start, static_kv.compiled_graphs() - graphs0
    log(f"compiled: {graphs} graphs in {compile_s:.1f} s")

    def mode(compiled: bool):
        return static_kv.compiled(ex) if compiled else nullcontext()

    def forward_s(compiled: bool, n: int) -> float:
        ids = torch.tensor([prompt], device=device)
        new = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.inference_mode(), mode(compiled):
            ex.begin_sample()
            cache, _ = kv.prefill(target, ids)
            times = []
            for _ in range(REPEATS + 1):  # the first warms this shape
                kv.crop(cache, L)
                _sync(device)
                t = time.perf_counter()
                kv.forward(target, new, cache)
                _sync(device)
                times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    forwards = []
    for n in ns:
        eager, compiled = forward_s(False, n), forward_s(True, n)
        limit = roofline.limit_seconds([[n, L, 0]], sizes, bw) if sizes and bw else None
        forwards.append(
            {
                "n": n,
                "eager_s": eager,
                "compiled_s": compiled,
                "limit_s": limit,
                "eager_roofline": limit / eager if limit else None,
                "compiled_roofline": limit / compiled if limit else None,
            }
        )
    ar: dict[str, Any] = {}
    for compiled in (False, True):
        with mode(compiled):
            ex.begin_sample()
            measure(build("ar", {}, target, None, workdir), prompt, T0, device)  # warmup
            ex.begin_sample()
            m = measure(build("ar", {}, target, None, workdir), prompt, T, device)
        total = m.step_times[-1]
        ar["compiled" if compiled else "eager"] = {
            "tokens_per_s": T / total,
            "roofline": roofline.sample_fraction(m.records, total, sizes, None, bw),
        }
    overhead = []
    for name, params in COMPILED_DECODERS:
        for compiled in (False, True):
            row: dict[str, Any] = {"decoder": name, "params": params, "mode": "compiled" if compiled else "eager"}
            try:
                with mode(compiled):
                    ex.begin_sample()  # warmup: compiles the shapes this decoder uses that were not compiled above
                    measure(build(name, params, target, draft, workdir), prompt, T0 + T, device)
                    runs = {}
                    for length in (T0, T0 + T):
                        totals = []
                        for _ in range(REPEATS):
                            ex.begin_sample()
                            totals.append(
                                _totals(measure(build(name, params, target, draft, workdir), prompt, length, device))
                            )
                        runs[length] = (
                            statistics.median(t[0] for t in totals),
                            statistics.median(t[1] for t in totals),
                            totals[0][2],
                        )
                (w0, f0, i0), (w1, f1, i1) = runs[T0], runs[T0 + T]
                iters = i1 - i0
                loop = max(0.0, (w1 - w0) - (f1 - f0))
                row.update(
                    iterations=iters,
                    overhead_s_per_iter=loop / iters if iters else None,
                    forward_s_per_iter=(f1 - f0) / iters if iters else None,
                    overhead_share=loop / max(w1 - w0, 1e-12),
                    ok=iters > 0,
                )
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            overhead.append(row)
            log(
                f"compiled {row['mode']} {name}: overhead {row.get('overhead_s_per_iter')} s/iter {row.get('error', '')}"
            )
    return {
        "ok": all(r["ok"] for r in overhead),
        "compile_s": compile_s,
        "graphs": graphs,
        "bandwidth": bandwidth,
        "prompt_tokens": L,
        "T": T,
        "forwards": forwards,
        "ar": ar,
        "overhead": overhead,
    }


# --- the command -------------------------------------------------------------------------------------------------


def environment(device) -> dict:
    """Versions and the device the check ran on."""
    import torch

    from dtbench.harness.machine import device_name

    def version(dist: str) -> str | None:
        from importlib import metadata

        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": device_name(device),
        "host": platform.node(),
        "torch_file": torch.__file__,
    }
    for dist in ("dtbench", "transformers", "sqlalchemy", "pydantic", "zeus", "nvidia-ml-py", "numpy"):
        env[dist] = version(dist)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count)
    return env


def summary(result: dict) -> dict:
    """The lines a closing note quotes: lossless verdicts, predicted vs paper speedups, loop overhead."""
    steps = result["steps"]
    out: dict[str, Any] = {}
    if "lossless" in steps and "rows" in steps["lossless"]:
        rows = steps["lossless"]["rows"]
        out["lossless"] = {
            "rows": len(rows),
            "passed": sum(r["ok"] for r in rows),
            "failed": [f"{r['arch']} {r['dtype']} {r['decoder']}" for r in rows if not r["ok"]],
            "ties": sum(r.get("ties") or 0 for r in rows),
        }
    if "costmodel" in steps and "predictions" in steps["costmodel"]:
        out["speedups"] = [
            {
                "method": p["method"],
                "dataset": p["dataset"],
                "paper": p["paper_speedup"],
                "predicted": p.get("predicted_speedup", p.get("predicted_speedup_range")),
                **(
                    {
                        "nodes_range": p["nodes_range"],
                        "nodes_implied_by_paper": p["nodes_implied_by_paper"],
                        "paper_inside_range": p["paper_inside_range"],
                    }
                    if "nodes_range" in p
                    else {}
                ),
            }
            for p in steps["costmodel"]["predictions"]
        ]
    if "overhead" in steps and "rows" in steps["overhead"]:
        out["overhead_ms_per_iter"] = {
            r["decoder"]: (None if r.get("overhead_s_per_iter") is None else round(r["overhead_s_per_iter"] * 1e3, 3))
            for r in steps["overhead"]["rows"]
        }
        out["host_reads_per_iter_max"] = {  # issue 46 item 1: at most 1 is the target
            r["decoder"]: (r.get("host_reads_per_iter_max"), r.get("cuda_syncs_per_iter_max"))
            for r in steps["overhead"]["rows"]
        }
    if "compiled" in steps and "forwards" in steps["compiled"]:
        c = steps["compiled"]
        out["compiled"] = {
            "compile_s": round(c["compile_s"], 1),
            "forward_ms": {
                str(f["n"]): [round(f["eager_s"] * 1e3, 3), round(f["compiled_s"] * 1e3, 3)] for f in c["forwards"]
            },
            "ar_tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in c["ar"].items()},
            "ar_roofline": {k: v["roofline"] for k, v in c["ar"].items()},
            "overhead_ms_per_iter": {
                f"{r['decoder']} {r['mode']}": None
                if r.get("overhead_s_per_iter") is None
                else round(r["overhead_s_per_iter"] * 1e3, 3)
                for r in c["overhead"]
            },
        }
    return out


def expected_ids(step: str, device, small: bool) -> list[str]:
    """Row ids of a decoder step in the order the step runs them (to name the row a crashed child was on)."""
    if step == "lossless":
        half = "float16" if device.type == "cuda" else "bfloat16"
        archs = ("llama",) if small else ("llama", "neox")
        return [f"{a}/{d}/{i}" for a in archs for d in ("float32", half) for i in range(len(lossless_decoders()))]
    if step == "overhead":
        return [str(i) for i, (n, _) in enumerate(OVERHEAD_DECODERS) if ONLY is None or n in ONLY]
    return []


def _describe(step: str, rid: str) -> dict:
    if step == "lossless":
        arch, dtype, i = rid.split("/")
        name, params = lossless_decoders()[int(i)]
        return {
            "arch": arch,
            "dtype": dtype,
            "decoder": name,
            "rule": "exact" if dtype == "float32" else "tie_aware",
            "params": {k: v for k, v in params.items() if not str(v).startswith("<")},
        }
    name, params = OVERHEAD_DECODERS[int(rid)]
    return {"decoder": name, "params": params}


def build_models(device, small: bool):
    """(target, draft, description): GPT-NeoX at Pythia-2.8B/70M shapes (fp16 on CUDA, fp32 on a CPU) or small."""
    import torch

    from dtbench.harness.curves_file import model_shape

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shapes = (SMALL_TARGET, SMALL_DRAFT) if small else (PYTHIA_2_8B, PYTHIA_70M)
    target, draft = neox(shapes[0], dtype, device, seed=0), neox(shapes[1], dtype, device, seed=1)
    desc = {
        "target": shapes[0],
        "draft": shapes[1],
        "dtype": str(dtype).removeprefix("torch."),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "target_shape": model_shape(target.config),  # what a curves file's prediction must match (issue 48)
        "draft_shape": model_shape(draft.config),
    }
    return target, draft, desc


def run_child(step: str, device, small: bool, rows_file: Path, skip: frozenset, log) -> None:
    """One step in this (child) process: rows and the step's result appended to ``rows_file`` as JSON lines."""

    def emit(obj: dict) -> None:
        with rows_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(obj, default=str) + "\n")

    workdir = Path(tempfile.mkdtemp(prefix="dtbench-gpucheck-"))
    models = None
    try:
        if step == "lossless":
            res = step_lossless(device, small, workdir, log, skip, lambda r: emit({"row": r}))
        else:
            target, draft, models = build_models(device, small)
            log(
                f"built target ({models['target_parameters'] / 1e9:.2f} B parameters) and draft "
                f"({models['draft_parameters'] / 1e6:.1f} M) in {models['dtype']}"
            )
            if step == "timing":
                res = step_timing(device, target, log)
            elif step == "costmodel":
                res = step_costmodel(device, target, draft, small, log)
            elif step == "compiled":
                res = step_compiled(device, target, draft, small, workdir, log)
            else:
                res = step_overhead(device, target, draft, small, workdir, log, skip, lambda r: emit({"row": r}))
    except Exception as exc:  # the step failed in Python: recorded, the parent goes on
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
        log(f"{step} FAILED: {res['error']}")
    res.pop("rows", None) if step in ("lossless", "overhead") else None
    emit({"result": res, "models": models})


# --- tests: the hypothesis property suite on this device (issue 38 item 3) -----------------------------------------

# the property tests parametrized over the device (models.DEVICES): equivalence, batched (B > 1), heads, training-free,
# compiled execution
TEST_MODULES = (
    "tests/test_equivalence.py",
    "tests/test_batching.py",
    "tests/test_heads.py",
    "tests/test_training_free.py",
    "tests/test_recycling_lookahead.py",
    "tests/test_compiled.py",
)
TEST_EXAMPLES = 5  # hypothesis examples per property test (models.EXAMPLES_ENV): within the check's 8 minutes
TEST_TIMEOUT_S = 300


def parse_hypothesis_statistics(text: str) -> dict[str, dict[str, int]]:
    """{test id: {"passing", "failing", "invalid"}} summed over phases, from pytest's ``--hypothesis-show-statistics``
    output (hypothesis's "Hypothesis Statistics" section: a ``path::test[param]:`` line, then per phase
    "- N passing, N failing, and N invalid test cases")."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^(\S+::\S+):\s*$", line)
        if head:
            current = out.setdefault(head.group(1), {"passing": 0, "failing": 0, "invalid": 0})
            continue
        # hypothesis 6.1xx: "N passing, N failing, and N invalid test cases" (older: "N passing examples, ...")
        counts = re.search(r"(\d+) passing\b.*?(\d+) failing\b.*?(\d+) invalid", line)
        if counts and current is not None:
            for key, value in zip(("passing", "failing", "invalid"), counts.groups(), strict=True):
                current[key] += int(value)
    return out


def parse_junit(path: Path) -> dict:
    """passed/failed/skipped counts and each failure (test id, message with hypothesis's falsifying example) from a
    pytest ``--junitxml`` file."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            text = f"{bad.get('message', '')}\n{bad.text or ''}"
            found = re.search(r"Falsifying example:.*?(?=\n\S|\Z)", text, re.S)
            failures.append(
                {"test": name, "falsifying_example": found.group(0) if found else None, "message": text[-1500:]}
            )
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def step_tests(device, out_dir: Path, log) -> dict:
    """Run the property tests' ``device`` parametrization (``-k cuda`` on a GPU, ``-k cpu`` on a CPU) in a pytest
    child (``-P``: the checkout's dtbench/ does not shadow the installed one) with :data:`TEST_EXAMPLES` examples per
    test and a :data:`TEST_TIMEOUT_S` limit; counts from its JUnit XML, example counts from
    ``--hypothesis-show-statistics``. Passes when something ran and nothing failed."""
    import os
    import subprocess

    root = _tests_dir().parent
    junit = out_dir / "tests.junit.xml"
    junit.unlink(missing_ok=True)
    selector = "cuda" if device.type == "cuda" else "cpu"
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_MODULES, "-k", selector]
    cmd += [f"--junitxml={junit}", "--hypothesis-show-statistics"]
    env = {**os.environ, "DTBENCH_HYPOTHESIS_EXAMPLES": str(TEST_EXAMPLES)}
    try:
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"pytest ran past {TEST_TIMEOUT_S} s", "modules": list(TEST_MODULES)}
    (out_dir / "tests.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if not junit.exists():
        return {
            "ok": False,
            "error": f"pytest exited {done.returncode}: {done.stdout[-500:]}",
            "modules": list(TEST_MODULES),
        }
    res = parse_junit(junit)
    stats = parse_hypothesis_statistics(done.stdout)
    log(f"tests: {res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped ({selector})")
    return {
        "ok": res["failed"] == 0 and res["passed"] > 0,
        "modules": list(TEST_MODULES),
        "selection": selector,
        "examples_per_test": TEST_EXAMPLES,
        **res,
        "hypothesis": stats,
        "examples_total": sum(v["passing"] + v["failing"] for v in stats.values()),
    }


# --- smoke: suites/gpu-smoke.yaml through `dtbench run` (issue 38 item 4) ------------------------------------------


def step_smoke(device, small: bool, out_dir: Path, log) -> dict:
    """``dtbench run`` of suites/gpu-smoke.yaml in a child process (the real Pythia shapes; ``--small`` or a CPU: the
    tiny shapes, float32, T = 12) into OUT/smoke.db, then ``dtbench report --format json``: each cell's status and
    lossless verdicts. Passes when every cell is done and no lossless decoder's sample failed its check."""
    import subprocess

    import yaml

    suite = yaml.safe_load((_tests_dir().parent / "suites" / "gpu-smoke.yaml").read_text(encoding="utf-8"))
    suite["calibrate"] = True  # the run's own curves: its cells predicted from them (issue 48, predict_smoke)
    if small or device.type != "cuda":
        suite.update(
            device=device.type,
            target={"model": "random:tiny:0", "dtype": "float32"},
            draft={"model": "random:tiny-draft:1", "dtype": "float32"},
            generation_lengths=[12],
        )
        suite["datasets"][0].update(prompts=2, L_max=24, params={"vocab": 512, "documents": 4, "length": 64})
    path, dbfile = out_dir / "smoke.yaml", out_dir / "smoke.db"
    path.write_text(yaml.safe_dump(suite), encoding="utf-8")
    dbfile.unlink(missing_ok=True)
    base = [sys.executable, "-P", "-m", "dtbench.cli.main"]
    run = subprocess.run(
        [*base, "run", str(path), "--db", str(dbfile), "--no-progress"], capture_output=True, text=True
    )
    (out_dir / "smoke.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    shown = subprocess.run([*base, "report", "--db", str(dbfile), "--format", "json"], capture_output=True, text=True)
    if shown.returncode != 0:
        return {"ok": False, "error": f"dtbench run exited {run.returncode}: {(run.stdout + run.stderr)[-500:]}"}
    cells = [
        {k: c.get(k) for k in ("label", "status", "n", "lossless", "throughput_mean", "error")}
        for c in json.loads(shown.stdout)["cells"]
    ]
    log(f"smoke: dtbench run exited {run.returncode}; " + ", ".join(f"{c['label']} {c['status']}" for c in cells))
    prediction = predict_smoke(base, dbfile, out_dir)
    log(
        f"smoke predicted from its own curves: speedup MAE {prediction.get('speedup_mae')} {prediction.get('error', '')}"
    )
    return {
        "prediction": prediction,
        "ok": run.returncode == 0 and all(c["status"] == "done" for c in cells) and bool(cells),
        "suite": suite["name"],
        "target": suite["target"]["model"],
        "draft": suite["draft"]["model"],
        "run_exit_code": run.returncode,
        "cells": cells,
        "note": "smoke test: random tokens and random weights say nothing about acceptance or speedup",
    }


def write_paper_curves(result: dict, out_dir: Path, log) -> None:
    """OUT/curves-paper.json (issue 48): the ``costmodel`` step's curves at the paper's shapes and caps, with the
    ``overhead`` step's loop overhead per iteration per decoder (eager), as a portable curves file for ``dtbench
    report --predict-on`` on a run of the real Pythia pair made elsewhere. Written when the costmodel step has
    points; its path goes into ``result["curves_files"]``."""
    from dtbench.harness import curves_file

    steps, models = result["steps"], result.get("models") or {}
    points = (steps.get("costmodel") or {}).get("points")
    if not points or not models.get("target_shape"):
        return
    overhead = {
        r["decoder"]: r["overhead_s_per_iter"]
        for r in (steps.get("overhead") or {}).get("rows", [])
        if r.get("overhead_s_per_iter") is not None
    }
    if overhead:
        overhead["*"] = statistics.median(overhead.values())
    env = result["environment"]
    doc = curves_file.document(
        points,
        device=str(env.get("device")),
        device_name=str(env.get("device_name")),
        models={
            role: {
                "model": f"random:{role}",
                "dtype": models.get("dtype"),
                "params": models.get(f"{role}_parameters"),
                "shape": models.get(f"{role}_shape"),
            }
            for role in ("target", "draft")
        },
        overhead_s=overhead,
        versions={k: str(env[k]) for k in ("torch", "transformers", "dtbench") if env.get(k)},
        source=f"gpu-check costmodel step on {env.get('device_name')}",
    )
    written = curves_file.write(out_dir / "curves-paper.json", doc)
    result.setdefault("curves_files", {})["paper"] = str(written)
    log(f"wrote {written} (the paper's shapes; overhead per iteration for {len(overhead)} decoders)")


def predict_smoke(base: list[str], dbfile: Path, out_dir: Path) -> dict:
    """Validation of the timing half (issue 48 item 3a): the smoke run's own calibration exported as a curves file
    (OUT/curves.json) and the smoke cells predicted from it with ``dtbench report --predict-on``, beside the
    measured speedups; the mean absolute speedup error over the non-AR cells."""
    import subprocess

    curves = out_dir / "curves.json"
    exported = subprocess.run(
        [*base, "report", "--db", str(dbfile), "--export-curves", str(curves)], capture_output=True, text=True
    )
    if exported.returncode != 0:
        return {"ok": False, "error": (exported.stdout + exported.stderr)[-300:]}
    shown = subprocess.run(
        [*base, "report", "--db", str(dbfile), "--predict-on", str(curves), "--format", "json"],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return {"ok": False, "curves": str(curves), "error": (shown.stdout + shown.stderr)[-300:]}
    cells = [
        {k: c.get(k) for k in ("label", "predicted_speedup", "measured_speedup", "predicted_throughput")}
        | {"measured_throughput": c.get("measured_throughput")}
        for c in json.loads(shown.stdout)["cells"]
    ]
    errors = [
        abs(c["predicted_speedup"] - c["measured_speedup"])
        for c in cells
        if c["measured_speedup"] and abs(c["measured_speedup"] - 1.0) > 1e-12
    ]
    return {
        "ok": bool(cells),
        "curves": str(curves),
        "cells": cells,
        "speedup_mae": statistics.fmean(errors) if errors else None,
    }


MAX_CRASHES = 8  # child processes a step may lose to crashes (a segfault in a decoder) before it gives up


def run_step(step: str, argv_base: list[str], device, small: bool, out_dir: Path, log) -> tuple[dict, dict | None]:
    """Run ``step`` in child processes (``python -X faulthandler``), so a crash of native code (a segfault) fails one
    row, not the check: the row the child was on is recorded as crashed with the tail of the child's stderr (the
    faulthandler's Python traceback), and a new child goes on after it."""
    import subprocess

    rows: dict[str, dict] = {}
    skip: set[str] = set()
    result, models = None, None
    rows_file = out_dir / f".{step}.jsonl"
    for _attempt in range(MAX_CRASHES + 1):
        rows_file.unlink(missing_ok=True)
        err_file = out_dir / f"{step}.stderr"
        cmd = [
            sys.executable,
            "-P",
            "-X",
            "faulthandler",
            "-m",
            "dtbench.cli.gpucheck",
            *argv_base,
            "--child",
            step,
            "--rows-file",
            str(rows_file),
            "--skip-ids",
            ",".join(sorted(skip)),
        ]
        with err_file.open("w", encoding="utf-8") as err:
            rc = subprocess.run(cmd, stderr=err).returncode
        lines = rows_file.read_text(encoding="utf-8").splitlines() if rows_file.exists() else []
        for line in lines:
            obj = json.loads(line)
            if "row" in obj:
                rows[obj["row"]["id"]] = obj["row"]
                skip.add(obj["row"]["id"])
            else:
                result, models = obj["result"], obj.get("models")
        if result is not None:
            break
        trace = err_file.read_text(encoding="utf-8", errors="replace").split("\nExtension modules:")[0][-1500:]
        how = f"crashed (signal {-rc})" if rc < 0 else f"child exited with {rc} and no result"
        pending = [i for i in expected_ids(step, device, small) if i not in skip]
        if not pending:
            result = {"ok": False, "error": f"{step} {how}", "crash_trace": trace}
            break
        crashed = pending[0]
        rows[crashed] = {"id": crashed, **_describe(step, crashed), "ok": False, "error": how, "crash_trace": trace}
        skip.add(crashed)
        if step == "lossless":  # the same decoder on the other pairs/dtypes: not retried (each crash costs a child)
            for other in pending[1:]:
                if other.split("/")[-1] == crashed.split("/")[-1]:
                    rows[other] = {
                        "id": other,
                        **_describe(step, other),
                        "ok": False,
                        "error": f"not run: this decoder crashed on {crashed}",
                    }
                    skip.add(other)
        log(f"{step} {crashed} {rows[crashed]['decoder']}: {how}; faulthandler: {trace.strip().splitlines()[-1:]}")
    else:
        result = {"ok": False, "error": f"{step}: more than {MAX_CRASHES} crashes"}
    rows_file.unlink(missing_ok=True)
    if step in ("lossless", "overhead"):
        order = expected_ids(step, device, small)
        result["rows"] = [rows[i] for i in order if i in rows]
        result["ok"] = bool(result.get("ok")) and all(r["ok"] for r in result["rows"]) and bool(result["rows"])
    return result, models


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder for gpu-check.json and gpu-check.log (created).",
)
@click.option(
    "--device",
    "device_name",
    default="auto",
    show_default=True,
    help="cuda, cpu, or auto (cuda when torch sees a GPU).",
)
@click.option("--small", is_flag=True, help="Small shapes instead of Pythia-2.8B/70M (the CPU dry run, tests).")
@click.option(
    "--steps", default=",".join(STEPS), show_default=True, help="Comma-separated subset of: " + ", ".join(STEPS) + "."
)
@click.option(
    "--decoders",
    default=None,
    help="Comma-separated decoder names: restrict steps lossless and overhead to them (default: every built-in).",
)
@click.option(
    "--budget",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds the whole check may take (a lease: 540). Steps then run most valuable first (tests, compiled, "
    "smoke, lossless, costmodel, overhead, timing); a step whose planned seconds do not fit is skipped and listed.",
)
@click.option(
    "--spent", type=click.FloatRange(min=0), default=0.0, help="Seconds of the budget already used (the install)."
)
@click.option("--plan", "plan_only", is_flag=True, help="Print the GPU plan against the budget (default 540 s); exit.")
@click.option("--child", default=None, hidden=True)
@click.option("--rows-file", type=click.Path(path_type=Path), default=None, hidden=True)
@click.option("--skip-ids", default="", hidden=True)
def main(
    out_dir: Path,
    device_name: str,
    small: bool,
    steps: str,
    decoders: str | None,
    budget: float | None,
    spent: float,
    plan_only: bool,
    child: str | None,
    rows_file: Path | None,
    skip_ids: str,
) -> None:
    """Run the offline GPU check (issue 31) and write OUT/gpu-check.json (each step in a child process)."""
    import torch

    global ONLY
    ONLY = {d.strip() for d in decoders.split(",") if d.strip()} if decoders else None
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STEPS]
    if bad or not chosen:
        raise click.UsageError(
            f"--steps: unknown step {bad[0]!r} (choose from {', '.join(STEPS)})"
            if bad
            else "--steps: name at least one step"
        )
    if plan_only:
        for line in gpu_budget.plan_lines("cuda", budget or gpu_budget.LEASE_BUDGET_S, spent):
            click.echo(line)
        return
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name not in ("cuda", "cpu"):
        raise click.UsageError(f"--device {device_name!r}: choose cuda, cpu or auto")
    if device_name == "cuda" and not torch.cuda.is_available():
        raise click.ClickException(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = (out_dir / "gpu-check.log").open("a", encoding="utf-8")
    began = time.perf_counter()

    def log(line: str) -> None:
        stamped = f"[{time.perf_counter() - began:7.1f}s]{' ' + child if child else ''} {line}"
        print(stamped, flush=True)
        log_file.write(stamped + "\n")
        log_file.flush()

    if child:
        assert rows_file is not None  # run_step passes --rows-file with every --child
        run_child(child, device, small, rows_file, frozenset(filter(None, skip_ids.split(","))), log)
        return
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "started": _now(),
        "small": small,
        "steps_requested": chosen,
        "decoders_requested": sorted(ONLY) if ONLY else None,
        "environment": environment(device),
        "steps": {},
    }
    path = out_dir / "gpu-check.json"

    def write() -> None:
        result["wall_s"] = time.perf_counter() - began
        result["finished"] = _now()
        result["ok"] = all(result["steps"].get(s, {}).get("ok", False) for s in chosen if s not in skipped)
        result["summary"] = summary(result)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")

    log(
        f"gpu-check on {result['environment']['device_name']} ({device}), torch {torch.__version__}, "
        f"steps {', '.join(chosen)}{' (small shapes)' if small else ''}"
    )
    argv_base = [
        "--out",
        str(out_dir),
        "--device",
        device_name,
        *(["--small"] if small else []),
        *(["--decoders", decoders] if decoders else []),
    ]
    order, skipped = gpu_budget.plan_steps(chosen, device.type, budget, spent)
    result["budget_s"], result["skipped_steps"] = budget, skipped
    if budget is not None:
        for line in gpu_budget.plan_lines(device.type, budget, spent):
            log(line)
    for step in order:
        why = gpu_budget.still_fits(step, device.type, budget, spent + time.perf_counter() - began)
        if why is not None:
            skipped[step] = why
            log(f"{step}: skipped ({why})")
            continue
        t0 = time.perf_counter()
        if step == "tests":
            res, models = step_tests(device, out_dir, log), None
        elif step == "smoke":
            res, models = step_smoke(device, small, out_dir, log), None
        else:
            res, models = run_step(step, argv_base, device, small, out_dir, log)
        if models:
            result["models"] = models
        res["seconds"] = time.perf_counter() - t0
        result["steps"][step] = res
        write()
        log(f"{step}: {'ok' if res['ok'] else 'FAILED'} in {res['seconds']:.1f} s")
    write_paper_curves(result, out_dir, log)
    write()
    log(f"wrote {path}: {'ok' if result['ok'] else 'FAILED'} in {result['wall_s']:.1f} s")
    log(json.dumps(result["summary"], default=str))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
