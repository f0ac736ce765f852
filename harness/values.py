"""Missing values and percentiles: the one test every report applies to a value (:func:`is_missing`) and the one
percentile helper (:func:`percentiles`; servers' latencies and their reports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


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
