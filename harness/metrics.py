"""Per-sample metrics: how a :class:`~dtbench.harness.measure.Measurement` becomes one ``samples`` row.

Definitions (DESIGN.md "Metrics"; README "Measurement protocol"):

- throughput = T / total wall time (tokens/s, prefill included); TTFT = time to the first committed token;
  TPOT = (total - TTFT) / (T - 1), seconds.
- iterations = target verifications (the prefill is the first); tokens per iteration L = T / iterations.
- acceptance_rate = committed drafted tokens / drafted depth, summed over iterations (accepted / K for linear
  speculation; for trees the committed path length before the bonus over the drafted tree's depth); at most 1.
- acceptance_incl_bonus = committed tokens *including* the bonus token / drafted depth, summed over the
  iterations that drafted: the DynaTree paper's Table 3 "Accept." convention, which can exceed 100%.
- mean_path_length = mean committed path length before the bonus token over the iterations that drafted;
  mean_path_length_all = the same over every iteration (the paper's ℓ, iterations that drafted nothing count 0).
- target_forwards / draft_forwards: forward passes counted by the runner's hooks (never declared by decoders);
  ``step_stats["target_fed"]`` / ``["draft_fed"]`` list each step's forwards as ``[n, past, flags]`` (tokens fed,
  KV positions before the forward, ``measure.FED_MASK | FED_LAST``), what the cost model prices (samples stored
  before they existed lack them).
- lossless: the output equals the reference's token for token; otherwise the first divergence is stored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

BASELINE = "ar"  # the reference decoder every speedup is measured against


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where ``tokens`` and ``reference`` differ (a length mismatch counts), or None."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import operator

            return operator.index(value)
        except TypeError:
            raise TypeError(f"Step.{what} must be an integer, got {value!r}") from None
    return value


def sample_row(m, prompt, warmup: bool, reference: list[int] | None) -> dict[str, Any]:
    """The samples-table columns of one measurement (definitions in this module's docstring).

    Args:
        m: a :class:`dtbench.harness.measure.Measurement`.
        prompt: the :class:`dtbench.harness.data.Prompt` it decoded.
        warmup: whether the prompt is one of the first W.
        reference: the reference decoder's tokens on this prompt, or None (the sample is a reference itself).

    Raises:
        TypeError: if a Step's counters are not integers (the runner fails the cell with it).
    """
    T = len(m.tokens)
    times = m.step_times
    total, ttft = times[-1], times[0]
    iterations = len(m.steps)
    drafted = [_int(s.drafted, "drafted") for s in m.steps]
    accepted = [_int(s.accepted, "accepted") for s in m.steps]
    depth = [_int(s.depth, "depth") for s in m.steps]
    tree_size = [_int(s.tree_size, "tree_size") for s in m.steps]
    committed = [len(s.tokens) for s in m.steps]
    drafting = [i for i, d in enumerate(drafted) if d > 0]
    depth_sum = sum(depth)
    target_fw = [r.target_forwards for r in m.records]
    draft_fw = [r.draft_forwards for r in m.records]
    draft_counted = all(d is not None for d in draft_fw)
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
        drafted=sum(drafted),
        accepted=sum(accepted),
        draft_depth=depth_sum,
        acceptance_rate=sum(accepted) / depth_sum if depth_sum else None,
        acceptance_incl_bonus=sum(committed[i] for i in drafting) / depth_sum if depth_sum else None,
        mean_path_length=sum(accepted[i] for i in drafting) / len(drafting) if drafting else None,
        mean_path_length_all=sum(accepted) / iterations,
        target_forwards=sum(target_fw),
        draft_forwards=sum(draft_fw) if draft_counted else None,
        step_tokens=committed,
        step_stats={
            "drafted": drafted,
            "accepted": accepted,
            "tree_size": tree_size,
            "depth": depth,
            "target_forwards": target_fw,
            "draft_forwards": draft_fw if draft_counted else None,
            "target_tokens": [r.target_tokens for r in m.records],
            "draft_tokens": [r.draft_tokens for r in m.records] if draft_counted else None,
            # per step, per forward in call order: [tokens fed n, KV positions before it, flags (measure.FED_*)]
            "target_fed": [getattr(r, "target_fed", None) or [] for r in m.records],
            "draft_fed": [getattr(r, "draft_fed", None) or [] for r in m.records] if draft_counted else None,
        },
        step_times_s=times,
        peak_rss_bytes=m.memory.rss_bytes,
        peak_allocated_bytes=m.memory.allocated_bytes,
        peak_nvml_bytes=m.memory.nvml_bytes,
        nvml_scope=getattr(m.memory, "nvml_scope", None),
        output_hash=hashlib.sha256(json.dumps(m.tokens).encode()).hexdigest(),
        output_tokens=m.tokens,
        lossless=(div is None) if reference is not None else None,
        first_divergence=div,
    )
