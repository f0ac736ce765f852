"""Pricing a measured sample on the calibration curves, and the chain and node-budget speedups predicted from them
(the cost model's arithmetic; :mod:`dtbench.reports.costmodel` tabulates it per cell and per batch size)."""

from __future__ import annotations

from typing import Any

from dtbench.harness.curves import FED_MASK

# --- pricing a sample -------------------------------------------------------------------------------------------


def step_forwards(stats: dict, role: str) -> tuple[list[list[list]], bool] | None:
    """Per step, the forwards of ``role`` as ``[n, past, flags]`` and whether they are approximate (rebuilt from
    the per-step counts of samples stored without per-forward records); None when the role was not counted."""
    fed = stats.get(f"{role}_fed")
    if fed is not None:
        return fed, False
    forwards, tokens = stats.get(f"{role}_forwards"), stats.get(f"{role}_tokens")
    if forwards is None or tokens is None:
        return None
    out = []
    for f, t in zip(forwards, tokens):
        f = int(f or 0)
        out.append([[t / f, None, 0]] * f if f else [])
    return out, True


def price_sample(curves, stats: dict, draft_model: bool = True) -> dict:
    """Predicted seconds of one sample: ``{"target_s", "draft_s", "predicted_s", "approx"}`` (``approx``: some
    forwards were rebuilt from per-step counts, or belong to a model the calibration lacks and are left out).
    ``draft_model=False``: the sample's draft forwards are not the suite's draft model's (a learned head's, a
    decoder without ``needs_draft``), so the draft curve does not price them: unpriced, flagged."""
    out: dict[str, Any] = {"target_s": 0.0, "draft_s": 0.0, "approx": False}
    for role in ("target", "draft"):
        got = step_forwards(stats, role)
        if got is None:
            continue
        steps, approx = got
        if role not in curves.roles() or (role == "draft" and not draft_model):  # unpriced, flagged
            out["approx"] |= any(steps)
            continue
        out["approx"] |= approx
        total = 0.0
        for forwards in steps:
            for n, past, flags in forwards:
                total += curves.cost(role, n, past, int(flags or 0))
        out[f"{role}_s"] = total
    out["predicted_s"] = out["target_s"] + out["draft_s"]
    return out


# --- chain decoders: acceptance per position, best K -------------------------------------------------------------


def position_acceptance(accepted: list[int], depth: list[int]) -> list[float]:
    """p_j, j = 1..max drafted depth: P(draft j accepted | drafts 1..j-1 accepted, j drafted), per step lists
    ``step_stats["accepted"]`` and ``["depth"]``: the acceptance profile's conditional acceptance, computed by the one
    function :func:`dtbench.reports.profile.conditional_acceptance`."""
    from dtbench.reports.profile import conditional_acceptance

    return conditional_acceptance(accepted, depth)


def expected_tokens(p: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i: committed tokens per iteration with chain length k (bonus included)."""
    total, run = 1.0, 1.0
    for j in range(min(k, len(p))):
        run *= p[j]
        total += run
    return total


def chain_speedups(curves, p: list[float], past: int) -> dict[int, float]:
    """S(k) for k = 1..len(p) (module docstring)."""
    ar = curves.cost("target", 1, past, 0)
    step = curves.cost("draft", 1, past, 2) if "draft" in curves.roles() else 0.0
    return {
        k: ar * expected_tokens(p, k) / (k * step + curves.cost("target", k + 1, past, 0)) for k in range(1, len(p) + 1)
    }


# --- tree decoders that record their node budget: best total_token ------------------------------------------------


def budget_speedups(curves, states: list[dict | None], head_s: float, past: int) -> dict[int, float]:
    """S(N) for verification sizes N = 2 .. the run's (root included) of a tree decoder whose samples record, per
    accepted token, the drafted-node budget its tree needed (``eagle``: ``accepted_tokens_needing_{m}_nodes`` and
    ``drafting_iterations`` in ``step_stats["state"]``). E(N) = 1 + (accepted tokens needing at most N - 1 nodes)
    / drafting iterations is exact for greedy verification of the best-N - 1 subtree; S(N) = AR token cost x E(N)
    / (``head_s`` + calibrated tree verification of N tokens), ``head_s`` the measured head seconds per drafting
    iteration (a head is not calibrated; its drafting does not depend on N). {} when nothing was recorded."""

    prefix = "accepted_tokens_needing_"
    needing: dict[int, int] = {}
    iterations = 0
    for state in states:
        iterations += int((state or {}).get("drafting_iterations") or 0)
        for key, count in (state or {}).items():
            if key.startswith(prefix) and key.endswith("_nodes"):
                m = int(key[len(prefix) : -len("_nodes")])
                needing[m] = needing.get(m, 0) + int(count)
    budget = max((int((state or {}).get("drafted_nodes") or 0) for state in states), default=0)
    if not iterations or not budget:
        return {}
    ar = curves.cost("target", 1, past, 0)
    out, accepted = {}, 0
    for n in range(2, budget + 2):
        accepted += needing.get(n - 1, 0)
        out[n] = ar * (1 + accepted / iterations) / (head_s + curves.cost("target", n, past, FED_MASK))
    return out
