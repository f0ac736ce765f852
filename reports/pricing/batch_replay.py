"""The batch prediction by replay (issue 39 item 5): a prompt group at batch size B predicted from its rows' B = 1
iterations on the calibrated curves (:func:`replay_speedup`), the batch table's predicted speedup
(:func:`dtbench.reports.pricing.costmodel_batch.batch_table`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from dtbench.reports.pricing.pricing import Pricer


@dataclass(frozen=True)
class RowTrace:
    """One prompt's B = 1 decode, as a batch replays it (:func:`replay_speedup`): greedy lossless rows commit the same
    tokens in the same iterations at any B (each row has its own proposer or draft session), so a row's widths and
    commits at B are its B = 1 sample's.

    Attributes:
        widths: per decode iteration the verification width (pending token + drafts), the prefill left out.
        committed: per decode iteration the tokens committed (accepted drafts + the bonus token).
        seconds: the row's own seconds per decode iteration outside the target: draft forwards (without the draft's
            prefill) plus its proposer's CPU time beyond ar's.
        tokens: new tokens of the sample.
        draft_prefill: seconds of the row's draft prefill (0 without a draft model).
    """

    widths: tuple[int, ...]
    committed: tuple[int, ...]
    seconds: float
    tokens: int
    draft_prefill: float


def row_traces(rows: pd.DataFrame, curves, l_max: int, ar_outside: float | None) -> list[RowTrace] | None:
    """The :class:`RowTrace` of every sample after warmup of a B = 1 cell (``rows``: :func:`b1_frame`), in prompt
    order (a prompt's first repeat only); None where a sample recorded no per-step drafts (stored before they were) or its iterations disagree.

    ``ar_outside``: ar's seconds per iteration outside forwards at B = 1 (the loop's own; beyond it a proposer's CPU
    time is priced per row), None where unknown (nothing added). The draft prefill is priced from the calibration's
    draft prefill curve at ``l_max`` tokens."""
    basis = rows[~rows["warmup"].astype(bool)]
    if "repeat" in basis:  # repeats of a prompt (suite keys repeats, min_groups) decode the same steps: one trace
        basis = basis.sort_values(["prompt_index", "repeat"]).drop_duplicates("prompt_index")
    basis = basis.sort_values("prompt_index")
    out = []
    for _, r in basis.iterrows():
        st = r["step_stats"] or {}
        drafted, accepted = st.get("drafted"), st.get("accepted")
        if not drafted or not accepted or len(drafted) != len(accepted) or len(drafted) < 1:
            return None
        fs = st.get("forward_s") or {}
        draft_s = float(fs.get("draft") or 0.0)
        draft_prefill = Pricer(curves).draft_prefill(l_max, draft_s > 0)
        decode = max(1, len(drafted) - 1)
        extra = 0.0
        if ar_outside is not None and fs.get("target") is not None and not pd.isna(r["total_s"]):
            outside = float(r["total_s"]) - float(fs.get("target") or 0.0) - draft_s
            extra = max(0.0, outside / len(drafted) - ar_outside)
        out.append(
            RowTrace(
                widths=tuple(1 + int(d) for d in drafted[1:]),
                committed=tuple(1 + int(a) for a in accepted[1:]),
                seconds=max(0.0, draft_s - draft_prefill) / decode + extra,
                tokens=int(r["new_tokens"]),
                draft_prefill=draft_prefill,
            )
        )
    return out or None


def replay_group(curves, group: list[RowTrace], l_max: int, family: str) -> float:
    """Predicted seconds of one prompt group decoded together: the prefill of its B prompts (where calibrated, plus
    each row's draft prefill), then per iteration one verification at the widest active row's width (a batch pads
    every row to it) over the rows still decoding (a row that is done leaves the batch), plus every active row's own
    seconds (drafts run per row), the cache at ``l_max`` + the longest row's commits."""
    pricer = Pricer(curves)
    prefill = pricer.prefill(l_max, len(group))
    seconds = (prefill + sum(r.draft_prefill for r in group)) if prefill is not None else 0.0
    done = [1] * len(group)  # tokens committed so far (the prefill's token)
    for j in range(max(len(r.widths) for r in group)):
        active = [i for i, r in enumerate(group) if j < len(r.widths)]
        width = max(group[i].widths[j] for i in active)
        seconds += pricer.verify_cost(width, l_max + max(done), len(active), family)
        for i in active:
            seconds += group[i].seconds
            done[i] += group[i].committed[j]
    return seconds


def replay_speedup(curves, traces: list[RowTrace], batch: int, l_max: int, gen_length: int, family: str) -> float:
    """Predicted speedup at batch size B by replaying the B = 1 rows (:class:`RowTrace`) in the run's prompt groups
    (consecutive prompts, B per group, a remainder left out as the measured side leaves it out): per group its tokens
    over :func:`replay_group`'s seconds, against ar's group (the same prefill, then T - 1 one-token steps of all B
    rows); the ratio of the mean group throughputs, the measured speedup's definition (Table 1's). NaN without a whole
    group."""
    groups = [traces[i : i + batch] for i in range(0, len(traces) - batch + 1, batch)]
    if not groups:
        return math.nan
    ar_rows = RowTrace((1,) * (gen_length - 1), (1,) * (gen_length - 1), 0.0, gen_length, 0.0)
    ar_seconds = replay_group(curves, [ar_rows] * batch, l_max, "ar")
    mine = [sum(r.tokens for r in g) / replay_group(curves, g, l_max, family) for g in groups]
    ar = [sum(r.tokens for r in g) / ar_seconds for g in groups]
    return (sum(mine) / len(mine)) / (sum(ar) / len(ar))
