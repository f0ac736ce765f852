"""Missing values, percentiles and divergences: the one test every report applies to a value (:func:`is_missing`),
the one percentile helper (:func:`percentiles`; servers' latencies and their reports) and where two outputs first
differ (:func:`first_divergence`; the lossless checks of decoders and servers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def is_missing(value: Any) -> bool:
    """None, NaN (float, numpy or pandas NA) or an empty string: the one test every report applies to a value."""
    if value is None or (isinstance(value, str) and not value):
        return True
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # lists, dicts
        return False


PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` (numpy's linear interpolation; the one percentile helper of servers' latencies and
    their reports); every one None when ``values`` is empty."""
    import numpy as np

    if not len(values):
        return {f"p{q}": None for q in PERCENTILES}
    qs = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, qs)}


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where ``tokens`` and ``reference`` differ (a length mismatch counts), or None."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))
