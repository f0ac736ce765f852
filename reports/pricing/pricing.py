"""The one pricing model of every prediction (issue 58 item 1): :class:`Pricer` prices forwards on calibration
curves — a sample's forwards (plus iterations x loop overhead), the target's cost of n tokens at batch size B, the
chain speedup S(K) at B, the best K at B, the tree budget at B. The cost model (``--cost-model``), ``--predict-on``,
the batch table and its replay, the schedules and ``n_max: auto`` (:func:`dtbench.harness.calibration.curves.tree_budget`, the
budget rule, where harness code can import it) are views of it, and so is the explanation of a measured cell
(``reports/pricing/explain.py``: the Pricer over the cell's own measured forwards, :class:`MeasuredCosts`).

One speedup formula (:meth:`Pricer.iteration_speedup`; issue 68 item 1): an iteration committing L tokens per row,
with a verification forward of V seconds and D drafting seconds per row, allows

    S = L x c_B(1) / (V + B x D)

and every speedup in reports/ and gpucheck/ is that, or a whole-cell ratio of costs read through the Pricer. S(K) at
B (Leviathan et al. 2023, the walltime improvement of a chain of K drafts, at batch size B) is its chain case:

    S(K) = E(K) x c_B(1) / (c_B(K + 1) + B x K x d),  E(K) = 1 + sum_{j<=K} prod_{i<=j} p_i

with c_B(n) the target's forward of n tokens per row at B (:func:`~dtbench.harness.calibration.curves.target_cost`:
causal at B = 1, the batched curves above), d the seconds of one drafted token (the calibrated draft step c_D(1)
unless the caller measured its own) and p the per-position acceptance. One rule for K: K = 1 .. len(p), the measured
positions only: p is never extended beyond the deepest drafted position (acceptance past it was not measured, and
the conditional p_j is not flat in j), so a best K is one the cell drafted to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dtbench.harness.calibration.curves import DEFAULT_FACTOR, FED_LAST, FED_MASK, Curves, target_cost, tree_budget

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


@dataclass(frozen=True)
class PricedSample:
    """One sample's forwards priced on calibration curves (:meth:`Pricer.sample`), seconds.

    Attributes:
        target_s, draft_s: the target's and the draft's forwards priced (0 for a role not priced).
        overhead_s: ``iterations`` x the decoder's loop overhead (0 without it).
        approx: some forwards were rebuilt from per-step counts, or belong to a model the calibration lacks (left
            out, so the figure is an underestimate).
    """

    target_s: float
    draft_s: float
    overhead_s: float
    approx: bool

    @property
    def predicted_s(self) -> float:
        """The predicted seconds of the sample: target + draft + loop overhead."""
        return self.target_s + self.draft_s + self.overhead_s


def price_sample(curves, stats: dict, draft_model: bool = True) -> PricedSample:
    """:meth:`Pricer.sample` of ``curves`` without loop overhead (the cost model's pricing of one sample)."""
    return Pricer(curves).sample(stats, draft_model)


# --- chain decoders: acceptance per position, best K -------------------------------------------------------------


def position_acceptance(accepted: list[int], depth: list[int]) -> list[float]:
    """p_j, j = 1..max drafted depth: P(draft j accepted | drafts 1..j-1 accepted, j drafted), per step lists
    ``step_stats["accepted"]`` and ``["depth"]``: the acceptance profile's conditional acceptance, computed by the one
    function :func:`dtbench.reports.views.profile.conditional_acceptance`."""
    from dtbench.reports.views.profile import conditional_acceptance

    return conditional_acceptance(accepted, depth)


def expected_tokens(p: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i: committed tokens per iteration with chain length k (bonus included)."""
    total, run = 1.0, 1.0
    for j in range(min(k, len(p))):
        run *= p[j]
        total += run
    return total


def chain_speedups(curves, p: list[float], past: int) -> dict[int, float]:
    """S(k) for k = 1..len(p) at B = 1 with the calibrated draft step: :meth:`Pricer.chain_speedups`."""
    return Pricer(curves).chain_speedups(p, past)


# --- tree decoders that record their node budget: best total_token ------------------------------------------------


def budget_speedups(curves, states: list[dict | None], head_s: float, past: int) -> dict[int, float]:
    """:meth:`Pricer.budget_speedups` of ``curves``."""
    return Pricer(curves).budget_speedups(states, head_s, past)


# --- the pricing model ------------------------------------------------------------------------------------------


@dataclass
class Pricer:
    """The one pricing model (module docstring; issue 58 item 1): forwards priced on ``curves``.

    Attributes:
        curves: the calibration (:class:`~dtbench.harness.calibration.curves.Curves`, seconds per forward), or one cell's
            measured means (:class:`MeasuredCosts`, the explanation's).
        overhead: loop overhead per iteration in seconds, per decoder name (a mapping, ``"*"`` for any other) or a
            function of the decoder name (:meth:`~dtbench.harness.calibration.curves_file.PortableCurves.overhead`); None: none
            (forwards only).
    """

    curves: Curves | MeasuredCosts
    overhead: Mapping[str, float] | Callable[[str], float | None] | None = None

    def loop_overhead(self, decoder: str | None) -> float:
        """Seconds of loop overhead per iteration of ``decoder`` (0 without any)."""
        if self.overhead is None or decoder is None:
            return 0.0
        if callable(self.overhead):
            got = self.overhead(decoder)
        else:
            got = self.overhead.get(decoder, self.overhead.get("*"))
        return float(got or 0.0)

    def target_cost(self, n: float, past: int | None, batch: int = 1, flags: int = 0) -> float:
        """Seconds of one target forward of n tokens per row at batch size B
        (:func:`~dtbench.harness.calibration.curves.target_cost`: the one ``batched_cost if batch > 1 else cost``)."""
        return target_cost(self.curves, n, past, batch, flags)

    def verify_cost(self, n: float, past: int | None, batch: int, family: str) -> float:
        """One verification forward of n tokens per row at B: the tree mask for a tree decoder at B = 1, else
        causal (B > 1: the batched curves)."""
        return self.target_cost(n, past, batch, FED_MASK if family == "tree" else 0)

    def draft_step(self, past: int | None) -> float:
        """Seconds of one calibrated draft step (one token, last-position logits) on a cache of ``past``; 0 where
        the calibration has no draft."""
        return self.curves.cost("draft", 1, past, FED_LAST) if "draft" in self.curves.roles() else 0.0

    def sample(
        self, stats: dict, draft_model: bool = True, iterations: int = 0, decoder: str | None = None
    ) -> PricedSample:
        """Predicted seconds of one sample (:class:`PricedSample`): every
        forward its steps ran priced on the curves, plus ``iterations`` x :meth:`loop_overhead` of ``decoder``
        (``approx``: some forwards were rebuilt from per-step counts, or belong to a model the calibration lacks and
        are left out). ``draft_model=False``: the sample's draft forwards are not the suite's draft model's (a
        learned head's, a decoder without ``needs_draft``), so the draft curve does not price them: unpriced,
        flagged."""
        curves = self.curves
        seconds = {"target": 0.0, "draft": 0.0}
        approx_any = False
        for role in ("target", "draft"):
            got = step_forwards(stats, role)
            if got is None:
                continue
            steps, approx = got
            if role not in curves.roles() or (role == "draft" and not draft_model):  # unpriced, flagged
                approx_any |= any(bool(s) for s in steps)
                continue
            approx_any |= approx
            total = 0.0
            for forwards in steps:
                for n, past, flags in forwards:
                    total += curves.cost(role, n, past, int(flags or 0))
            seconds[role] = total
        overhead = iterations * self.loop_overhead(decoder)
        return PricedSample(seconds["target"], seconds["draft"], overhead, approx_any)

    def chain_speedups(
        self,
        p: list[float],
        past: int,
        batch: int = 1,
        draft_token_s: float | None = None,
        k_max: int | None = None,
    ) -> dict[int, float]:
        """S(K) at batch size ``batch`` for K = 1 .. len(p) (at most ``k_max``), the one chain speedup (module
        docstring): ``draft_token_s`` the seconds of one drafted token per row (None: :meth:`draft_step`), the
        target on a cache of ``past``. {} without p."""
        top = len(p) if k_max is None else min(len(p), k_max)
        return {k: self.chain_speedup(expected_tokens(p, k), k, past, batch, draft_token_s) for k in range(1, top + 1)}

    def chain_speedup(
        self, tokens: float, k: float, past: int | None, batch: int = 1, draft_token_s: float | None = None
    ) -> float:
        """S of a chain committing ``tokens`` per iteration with ``k`` drafted tokens per row (a mean is fine): one
        causal verification of k + 1 tokens per row and k drafted tokens at ``draft_token_s`` seconds each (None:
        :meth:`draft_step`), :meth:`iteration_speedup`. :meth:`chain_speedups` calls it with E(K)."""
        d = self.draft_step(past) if draft_token_s is None else draft_token_s
        return self.iteration_speedup(tokens, self.target_cost(k + 1, past, batch, 0), k * d, past, batch)

    def iteration_speedup(
        self, tokens: float, verify_s: float, draft_s: float, past: int | None, batch: int = 1
    ) -> float:
        """The one speedup formula of every prediction (module docstring): ``tokens`` committed per row and
        iteration x c_B(1) / (``verify_s`` + B x ``draft_s``), with ``verify_s`` the seconds of the iteration's
        verification forward (all B rows) and ``draft_s`` the drafting seconds per row and iteration; the target on
        a cache of ``past``. NaN when the iteration costs nothing."""
        spent = verify_s + batch * draft_s
        return tokens * self.target_cost(1, past, batch, 0) / spent if spent > 0 else float("nan")

    def draft_prefill(self, l_max: int, has_draft: bool = True) -> float:
        """Seconds of one draft prefill of ``l_max`` prompt tokens: 0 without a draft model (``has_draft`` False)
        or without a draft in the calibration (the one guard of every prediction)."""
        return self.curves.cost("draft", l_max, 0) if has_draft and "draft" in self.curves.roles() else 0.0

    def prefill(self, l_max: int, batch: int = 1) -> float | None:
        """Seconds of the target's prefill of ``batch`` prompts of ``l_max`` tokens (None where not calibrated:
        :meth:`~dtbench.harness.calibration.curves.Curves.batched_prefill`)."""
        return self.curves.batched_prefill(l_max, batch)

    def forward_cost(self, role: str, n: int, past: int | None, flags: int = 0) -> float:
        """Seconds of one forward of ``role`` ("target" or "draft") feeding ``n`` tokens after ``past`` cached
        positions with mask ``flags`` (:meth:`~dtbench.harness.calibration.curves.Curves.cost`).

        Raises:
            KeyError: the calibration has no such role."""
        return self.curves.cost(role, n, past, flags)

    def best_k(
        self,
        p: list[float],
        past: int,
        batch: int = 1,
        draft_token_s: float | None = None,
        k_max: int | None = None,
    ) -> tuple[int, float] | None:
        """(K, S(K)) of the highest :meth:`chain_speedups` (the smallest K on a tie); None without p."""
        speed = self.chain_speedups(p, past, batch, draft_token_s, k_max)
        if not speed:
            return None
        best = max(speed, key=lambda k: speed[k])
        return best, speed[best]

    def budget(self, past: int, batch: int = 1, factor: float = DEFAULT_FACTOR, ceiling: int | None = None) -> int:
        """The tree budget at B: :func:`dtbench.harness.calibration.curves.tree_budget` (the rule of ``n_max: auto``).

        Raises:
            TypeError: the Pricer prices a cell's measured means (:class:`MeasuredCosts`), not calibration curves."""
        if isinstance(self.curves, MeasuredCosts):
            raise TypeError("a tree budget needs calibration curves, not one cell's measured means")
        return tree_budget(self.curves, past, batch, factor, ceiling)

    def budget_speedups(self, states: list[dict | None], head_s: float, past: int) -> dict[int, float]:
        """S(N) for verification sizes N = 2 .. the run's (root included) of a tree decoder whose samples record,
        per accepted token, the drafted-node budget its tree needed (``eagle``: ``accepted_tokens_needing_{m}_nodes``
        and ``drafting_iterations`` in ``step_stats["state"]``). E(N) = 1 + (accepted tokens needing at most N - 1
        nodes) / drafting iterations is exact for greedy verification of the best-N - 1 subtree; S(N) = AR token
        cost x E(N) / (``head_s`` + calibrated tree verification of N tokens), ``head_s`` the measured head seconds
        per drafting iteration (a head is not calibrated; its drafting does not depend on N). {} when nothing was
        recorded."""
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
        out, accepted = {}, 0
        for n in range(2, budget + 2):
            accepted += needing.get(n - 1, 0)
            verify = self.verify_cost(n, past, 1, "tree")
            out[n] = self.iteration_speedup(1 + accepted / iterations, verify, head_s, past)
        return out


@dataclass(frozen=True)
class MeasuredCosts:
    """One cell's own measured per-forward seconds served as curves (issue 68 item 1), so that the explanation of
    a measured cell is priced by the same :class:`Pricer` as every prediction: a target forward of one token costs
    ``ar_s`` (the reference ``ar`` cell's mean decode forward), any wider target forward ``verify_s`` (the cell's
    own mean decode forward: its verification of K + 1 or tree tokens), a draft forward ``draft_s`` (the cell's
    mean draft decode forward; 0 without a draft). Seconds; cache length and mask flags do not apply (the means
    are over the cell's own)."""

    ar_s: float
    verify_s: float
    draft_s: float = 0.0

    def roles(self) -> set[str]:
        """The roles priced: the target, and the draft where one ran."""
        return {"target", "draft"} if self.draft_s > 0 else {"target"}

    def cost(self, role: str, n: float, past: int | None, flags: int = 0) -> float:
        """Seconds of one forward of ``role`` feeding ``n`` tokens (the measured means above)."""
        if role == "draft":
            return self.draft_s
        return self.ar_s if n <= 1 else self.verify_s

    def batched_cost(self, n: float, past: int | None, rows: int, role: str = "target") -> float:
        """Not measured: a cell's means are at its own batch size.

        Raises:
            KeyError: always (the explanation prices B = 1 cells only)."""
        raise KeyError("a cell's measured costs are at B = 1")

    def batched_prefill(self, n: int, rows: int, role: str = "target") -> float | None:
        """None: the explanation leaves the prefill apart."""
        return None


def leviathan_bound(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. 2023 (eq. 1 and Section 3.4): the walltime improvement of a chain of ``k`` drafts accepted
    i.i.d. at rate ``alpha`` (0..1) with a draft forward costing ``c`` target forwards, E(k) / (k c + 1), where E(k) =
    (1 - alpha^(k+1)) / (1 - alpha) is the one expected committed length of the pricing model
    (:func:`expected_tokens` with every position accepted at ``alpha``), priced by the one
    :class:`Pricer` with a verification of k + 1 tokens costing one AR forward (the paper's
    assumption: that is why it bounds a chain whose verification costs more)."""
    return Pricer(MeasuredCosts(1.0, 1.0, c)).chain_speedup(expected_tokens([alpha] * k, k), k, None)
