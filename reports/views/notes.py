"""The one-line notes a reader needs beside a cell (issue 40 item 5: the one set every table and paper table uses) and
the lossless verdict's details: failures, partial and warmup-only cells, a decoder that is not lossless, mixed devices,
numeric ties, missing energy, a busy machine, a smoke cell."""

from __future__ import annotations

import pandas as pd

from dtbench.harness.errors import clip
from dtbench.harness.measurement import load
from dtbench.reports.stats import is_missing as _missing


def mixed_devices_note(row, where: str = "") -> list[str]:
    """The note owed to a cell whose samples came from different device models (``mixed_devices``), else []."""
    if not bool(row.get("mixed_devices", False)):
        return []
    return [
        f"{row['label']}{where}: its samples were measured on {len(row['devices'])} different devices "
        f"({'; '.join(row['devices'])}); speedups across different GPUs are not comparable"
    ]


def cell_notes(row: pd.Series, where: str = "") -> list[str]:
    """One-line notes a reader needs beside a cell, the one set every table and paper table uses: a smoke cell, a
    failure, a partial cell, a cell with only warmup, a speedup left out for a partial baseline, a decoder meant to
    be lossless that is not, a cell measured on different devices, numeric ties found by the lossless check, missing
    energy, a busy machine. ``where`` follows the label where a table spans datasets (`` on wikitext-2``)."""
    return (
        smoke_note(row)
        + _state_notes(row, where)
        + failed_requests_note(row, where)
        + verdict_notes(row, where)
        + mixed_devices_note(row, where)
        + lossless_notes(row, where)
        + energy_note(row, where)
        + load_note(row)
    )


SMOKE_NOTE = "smoke test: random tokens and random weights say nothing about acceptance or speedup"


def smoke_note(row) -> list[str]:
    """The note owed to a cell of the GPU smoke suite (issue 38): prompts from the built-in ``random-tokens`` dataset
    or a ``random:<shape>`` target (random weights), whose acceptance and speedups measure nothing real."""
    target = str(row.get("target_model") or "")
    if str(row.get("dataset") or "").startswith("random-tokens") or target.startswith("random:"):
        return [SMOKE_NOTE]
    return []


def load_note(row) -> list[str]:
    """The note owed to a cell measured on a busy machine (:func:`dtbench.harness.measurement.load.note`: its load, the share of
    CPU time other processes took), else []."""
    text = load.note(row)
    return [text] if text else []


def energy_note(row, where: str = "") -> list[str]:
    """The note owed to a cell whose samples were too short for the energy counter (their energy is missing)."""
    short = int(row.get("energy_too_short", 0) or 0)
    if not short:
        return []
    return [
        f"{row['label']}{where}: no energy for {short} of {int(row['n'])} samples: shorter than the energy counter's "
        f"update period"
    ]


def failed_requests_note(row, where: str = "") -> list[str]:
    """The note owed to a served cell some of whose requests failed (issue 67 item 4): how many of those sent after
    warmup, the rate, and what its numbers are over; [] for a cell none of whose requests failed, or not served."""
    failed, sent = row.get("failed_requests"), row.get("requests")
    if failed is None or sent is None or pd.isna(failed) or pd.isna(sent) or not int(failed):
        return []
    failed, sent = int(failed), int(sent)
    return [
        f"{row['label']}{where}: {failed} of {sent} requests failed ({failed / sent:.0%}); its numbers are over the "
        f"{sent - failed} that answered (report --engine lists each failure and --goodput counts them as misses)"
    ]


def _state_notes(row: pd.Series, where: str = "") -> list[str]:
    label, error = row["label"], clip(row["error"] or "unknown error", 300)
    n, warmup_n = int(row.get("n", 0) or 0), int(row.get("warmup_n", 0) or 0)
    if bool(row.get("partial", False)):
        shown = (
            "its numbers are left out (--include-partial shows them)"
            if bool(row.get("partial_hidden", False))
            else "its numbers come from those prompts only"
        )
        return [
            f"{label} is partial{where}: it failed after {n + warmup_n} measured prompts ({n} after warmup), "
            f"{shown}: {error}"
        ]
    if row["status"] == "failed":
        after = f" after {n + warmup_n} measured prompts" if n + warmup_n else ""
        return [f"{label} failed{where}{after}: {error}"]
    if row["status"] == "interrupted":  # issue 50 item D: the run stopped while this cell was under way
        return [
            f"{label}{where} was interrupted after {n + warmup_n} measured prompts ({n} after warmup): its numbers "
            "come from those prompts only (--resume continues it)"
        ]
    if bool(row.get("all_warmup", False)) and int(row.get("remainder_n", 0) or 0):
        return [  # a batch size above the measured prompts (refused at validate since issue 42; older runs)
            f"{label}{where}: no full batch of B={int(row['batch_size'])} after warmup ({int(row['remainder_n'])} "
            f"measured prompts, decoded as a smaller batch and left out), so it has no numbers at "
            f"B={int(row['batch_size'])}"
        ]
    if bool(row.get("all_warmup", False)):
        return [
            f"{label}{where}: all {warmup_n} measured prompts are warmup, so it has no numbers after warmup "
            "(the suite's prompts must exceed its warmup)"
        ]
    if bool(row.get("partial_hidden", False)):  # a paper table's cell whose AR baseline is partial
        return [f"{label}{where}: speedup left out, its AR baseline is partial (--include-partial shows it)"]
    return []


def verdict_notes(row, where: str = "") -> list[str]:
    """The note owed to a decoder meant to be lossless whose output check failed: under the tie-aware rule how many
    samples emitted a token the target does not choose (first at which token, its margin), under the exact rule how
    many samples match the reference and where the first diverged."""
    if row.get("lossless") != "no" or not bool(row.get("lossless_expected", True)):
        return []
    label = row["label"]
    if row.get("lossless_rule") == "tie_aware" and not _missing(row.get("lossless_first_error")):
        margin = row.get("lossless_error_margin")
        return [
            f"{label} is not lossless{where}: {row['lossless_n']} samples (warmup included) pass the tie-aware "
            f"check; {int(row['lossless_error_samples'])} emitted a token the target does not choose (first at "
            f"token {int(row['lossless_first_error'])}"
            + ("" if _missing(margin) else f", margin {margin:.3g} logits")
            + ")"
        ]
    first = f", first divergence at token {row['divergences'][0]}" if len(row.get("divergences") or []) else ""
    return [
        f"{label} is not lossless{where}: {row['lossless_n']} samples (warmup included) match "
        f"{row.get('reference') or 'AR'}{first}"
    ]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def lossless_detail(row) -> str:
    """The parenthesis after a Lossless verdict: ``(2 ties)``, ``(error at 57, margin 3.1)`` (tie-aware rule),
    ``(first at 29)`` (exact rule, or a cell stored before the check), with the target dtype when there are ties or
    errors; "" when there is nothing to add."""
    ties, errors = row.get("lossless_ties"), row.get("lossless_error_samples")
    checked = not _missing(ties)
    parts = []
    if row.get("lossless_rule") == "tie_aware" and checked:
        if errors and not _missing(row.get("lossless_first_error")):
            margin = row.get("lossless_error_margin")
            parts.append(
                f"error at {int(row['lossless_first_error'])}" + ("" if _missing(margin) else f", margin {margin:.3g}")
            )
    elif row["lossless"] == "no" and len(row.get("divergences") or []):
        parts.append(f"first at {row['divergences'][0]}")
    if checked and ties:
        parts.append(_plural(int(ties), "tie"))
    if row.get("lossless_rule") == "exact" and checked and errors:
        parts.append(_plural(int(errors), "sample") + " with errors")
    if checked and (ties or errors) and row.get("target_dtype"):
        parts.append(str(row["target_dtype"]))
    return f" ({', '.join(parts)})" if parts else ""


def lossless_notes(row, where: str = "") -> list[str]:
    """The note owed to a cell whose checked samples had numeric ties: how many, the largest tie margin, the target
    dtype, and what the rule makes of them (tie-aware: ties pass; exact: only an output that differs from the
    reference's fails, so "yes 2/2 (1 tie)" is consistent: the tie did not change the output)."""
    ties = row.get("lossless_ties")
    if _missing(ties) or not ties:
        return []
    dtype = f" (target {row['target_dtype']})" if row.get("target_dtype") else ""
    margin = row.get("lossless_max_tie_margin")
    largest = "" if _missing(margin) else f", largest tie margin {margin:.3g} logits"
    # The exact rule's verdict is "the output equals the reference's": a tie fails it only where the tie changed the
    # output (the Lossless column's count says how many samples), not by being found.
    rule = (
        "ties pass the tie-aware check"
        if row.get("lossless_rule") == "tie_aware"
        else "the exact rule fails a sample only where its output differs from the reference's"
    )
    return [
        f"{row['label']}{where}: {_plural(int(ties), 'numeric tie')} in {int(row['lossless_tie_samples'])} of "
        f"{int(row['lossless_checked_n'])} samples{dtype}{largest}: the target's top logits there are within "
        f"the noise between the incremental and the verification computation; {rule}"
    ]
