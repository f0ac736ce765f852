"""The cell-statistics layer every report shares: which cells are compared, how, and how a missing value reads.

- The *group* of a cell is its (dataset, L_max, T) (:data:`GROUP`); a cell is identified within a run by its group
  and label (:data:`KEY`).
- A cell's *reference for speedups* is the baseline decoder's (:data:`BASELINE`, greedy full-cache AR) cell of the
  same group that decodes the same way (:func:`decoding`: greedy, or the same sampling settings). Sampled cells are
  never divided by greedy AR.
- Fewer than :data:`MIN_PROMPTS` prompts after warmup give no interval and no verdict: :data:`N_TOO_SMALL`.

The paper's speedup (section 4.1, Table 1) is mean throughput over the reference's mean throughput; the paired
per-prompt ratios (decoder / reference throughput on the same prompt) give its confidence interval.
"""

from __future__ import annotations

import json

from dtbench.harness.metrics import BASELINE

GROUP = ["dataset", "l_max", "gen_length"]
KEY = [*GROUP, "label"]

# Below this many prompts after warmup (paired with AR's for a speedup; per side for a run-to-run test) no
# confidence interval and no verdict is shown, only "n too small". With n = 5 the t quantile of a 95% interval is
# 2.78 (n = 2: 12.7, n = 3: 4.30) and a two-sided Mann-Whitney U test can reach p = 0.008 (n = 3 per side: 0.10,
# never significant at 0.05); below that an interval mostly reflects two or three prompts' luck.
MIN_PROMPTS = 5
N_TOO_SMALL = "n too small"

__all__ = ["BASELINE", "GROUP", "KEY", "MIN_PROMPTS", "N_TOO_SMALL", "decoding"]


def decoding(sampling) -> str:
    """How a cell decodes: ``"greedy"``, or its sampling settings (a ``cells.sampling`` dict) as a canonical JSON
    string. Speedups pair a cell only with a baseline cell of the same decoding."""
    return json.dumps(sampling, sort_keys=True) if isinstance(sampling, dict) and sampling else "greedy"
