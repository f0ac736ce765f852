"""Step d, **loop overhead**: each decoder's time outside model forwards per iteration at the paper's shapes
(:func:`step_overhead`; the package docstring)."""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtbench.gpucheck import common
from dtbench.gpucheck.common import AR_THROUGHPUT, PAPER, T_PAPER, build, crash_if_asked

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
    # the same trees with their drafting decided on the device (decoders/tree/resident.py, issue 46 item 1): the
    # loop overhead and host reads of each mode beside the host-driven rows above (ids stay stable: appended)
    ("dynatree", {"resident": "draft"}),
    ("dynatree", {"resident": "full"}),
    ("fixed_tree", {"depth": 8, "branching": 3, "tau": 0.1, "resident": "full"}),
)


REPEATS = 3  # measurements per length in step d (medians)


def totals(m) -> tuple[float, float, int]:
    """(wall seconds, seconds inside target + draft forwards, iterations) of one measurement."""
    fwd = m.forward_s or {}
    return m.step_times[-1], (fwd.get("target") or 0.0) + (fwd.get("draft") or 0.0), len(m.steps)


def medians(run: Callable[[], Any]) -> tuple[float, float, int, Any]:
    """(median wall seconds, median forward seconds, iterations of the first, the last measurement) of
    :data:`REPEATS` calls of ``run`` (each returns a :class:`~dtbench.harness.measurement.measure.Measurement`)."""
    runs = [run() for _ in range(REPEATS)]
    each = [totals(m) for m in runs]
    return statistics.median(t[0] for t in each), statistics.median(t[1] for t in each), each[0][2], runs[-1]


def differential(short: tuple[float, float, int, Any], long: tuple[float, float, int, Any]) -> tuple[int, float]:
    """(extra iterations, extra seconds outside forwards, at least 0) of the ``long`` run over the ``short`` one
    (:func:`medians` of each): the prefill and warmup cancel."""
    (w0, f0, i0, _), (w1, f1, i1, _) = short, long
    return i1 - i0, max(0.0, (w1 - w0) - (f1 - f0))


def _reads(decoder, prompt: list[int], T: int, device) -> dict[str, Any]:
    """Device-to-host reads and (on CUDA) the synchronizations CUDA reports, per iteration after the prefill's
    (issue 46 item 1, :func:`dtbench.harness.measurement.host_reads.reads_per_iteration`): the most in one iteration and the
    median."""
    from dtbench.harness.measurement.host_reads import reads_per_iteration

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
    overhead per iteration = (extra wall time - extra time inside forwards) / extra iterations. Forward times are the
    forward timer's (:class:`~dtbench.harness.measurement.forwards.ForwardTimer`: CUDA events on a GPU).
    """
    import torch

    from dtbench.harness.measurement.measure import measure

    vocab = target.config.vocab_size
    L, T0, T = (24, 2, 24) if small else (800, 8, 64)
    prompt = torch.randint(3, vocab, (L,), generator=torch.Generator().manual_seed(1)).tolist()
    paper_iter_s = {r.method: T_PAPER / r.throughput / r.iterations for r in PAPER if r.dataset == "wikitext-2"}
    paper_iter_s["ar"] = 1 / AR_THROUGHPUT["wikitext-2"]
    rows = []
    for i, (name, params) in enumerate(OVERHEAD_DECODERS):
        if (common.ONLY is not None and name not in common.ONLY) or str(i) in skip:
            continue
        crash_if_asked(name)
        row: dict[str, Any] = {"id": str(i), "decoder": name, "params": params}
        try:
            measure(build(name, params, target, draft, workdir), prompt, T0, device)  # warmup

            def run(length: int, name: str = name, params: dict = params):  # bound per decoder
                return lambda: measure(build(name, params, target, draft, workdir), prompt, length, device)

            short, long = medians(run(T0)), medians(run(T0 + T))
            (w0, f0, _, _), (w1, f1, _, m) = short, long
            iters, loop = differential(short, long)
            row.update(
                iterations=iters, tokens=T, wall_s=w1 - w0, forward_s=f1 - f0, forwards_timed=m.forward_s is not None
            )
            if iters > 0:
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
