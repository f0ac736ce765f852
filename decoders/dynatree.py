"""DynaTree: confidence-aware adaptive tree drafting (the paper's method, sections 3.2-3.3, Appendix D).

Three components, each switchable for the ablation (paper 4.5, Table 4):

- dynamic breadth: B(u) in {B_min, B_mid, B_max} from the draft confidence c(u) = max_v q_D(v | u) against
  tau_h > tau_l (:func:`breadth_rule`);
- dynamic depth: expand u iff d(u) < D_max and p(u) >= rho_stop and (d(u) < D_0 or p(u) >= rho_deep), with
  p(u) the cumulative draft path probability (:func:`depth_gate`);
- history adaptation: proportional control of D_0, tau_h and (``adapt_tau_l``) tau_l towards a target
  acceptance a* from the mean a_bar of the last W per-iteration acceptances (Algorithm 1 line 7,
  ADJUST(tau_l, tau_h, D_0); :class:`HistoryController`).

Pruning (p(u) < tau) and the node budget N_max are the shared toolkit's, as are drafting, tree-masked
verification, path selection and cache updates (:mod:`dtbench.decoders.tree`). With all three components
off, DynaTree is the fixed tree with D = d0 and B = branching (same ``tree_root`` and ``prune``).

Depths: with ``tree_root: paper`` (the default) d(u) counts from the draft's top-1 token u0 at depth 0, as
D_0 and D_max do in the paper; with ``tree_root: pending`` from the pending token (first drafted level 1).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, overload

import torch
from pydantic import AliasChoices, Field, model_validator

from dtbench.decoders.base import Step
from dtbench.decoders.tree import ExpansionPolicy, TreeDecoder, TreeParams, resolved_n_max


def breadth_rule(
    confidence: torch.Tensor, tau_h: float, tau_l: float, b_min: int, b_mid: int, b_max: int
) -> torch.Tensor:
    """Per-node branching factor, paper 3.3:

        B(u) = B_min if c(u) >= tau_h;  B_mid if tau_l <= c(u) < tau_h;  B_max if c(u) < tau_l.

    Args:
        confidence: (E,) float, c(u) = max_v q_D(v | u), a probability.
        tau_h, tau_l: confidence thresholds (the c >= tau_h case is tested first, so the rule stays defined
            if history adaptation moves tau_h below tau_l).
        b_min, b_mid, b_max: branch bounds.

    Returns:
        (E,) int64.
    """
    b = torch.full(confidence.shape, b_max, dtype=torch.long, device=confidence.device)
    b = torch.where(confidence >= tau_l, b_mid, b)
    return torch.where(confidence >= tau_h, b_min, b)


def depth_gate(
    depth: int, cum_logp: torch.Tensor, d0: float, d_max: int, rho_stop: float, rho_deep: float
) -> torch.Tensor:
    """Dynamic depth control, paper 3.3: u is expandable iff

        d(u) < D_max  and  p(u) >= rho_stop  and  (d(u) < D_0  or  p(u) >= rho_deep),

    evaluated in log space (log p(u) = cumulative draft log-probability).

    Args:
        depth: d(u) of the nodes (all the same).
        cum_logp: float tensor (any shape), log p(u).
        d0: base depth D_0 (a float under history adaptation: d < D_0 then means d < ceil(D_0)).
        d_max: hard maximum depth D_max.
        rho_stop, rho_deep: probability thresholds, 0 < rho_stop < rho_deep < 1.

    Returns:
        bool tensor shaped like ``cum_logp``.
    """
    if depth >= d_max:
        return torch.zeros(cum_logp.shape, dtype=torch.bool, device=cum_logp.device)
    ok = cum_logp >= math.log(rho_stop)
    if depth < d0:
        return ok
    return ok & (cum_logp >= math.log(rho_deep))


class HistoryController:
    """History adaptation (paper 3.3, "Historical adjustment"; Algorithm 1 line 7, ADJUST(tau_l, tau_h, D_0)).

    a_r is the per-iteration acceptance statistic of the paper's text: the fraction of drafted tokens
    committed in iteration r, a_r = accepted_r / drafted_r (committed drafted tokens before the bonus over
    drafted nodes; iterations that drafted nothing are not recorded). a_bar is the mean of the last W
    recorded a_r (of all of them while fewer than W exist). After every recorded iteration, with
    e = a_bar - a*:

        D_0   <- clip(D_0   + eta_D * e, 1, D_max - 1)
        tau_h <- clip(tau_h - eta_h * e, 0, 1)
        tau_l <- clip(tau_l - eta_l * e, 0, 1)      (only when adapting tau_l; eta_l = None leaves it)

    The tau_l update is the tau_h one (section 3.3 gives only the D_0 and tau_h forms and says the rest
    "follow the same principle"): high acceptance lowers both confidence thresholds, so fewer nodes get
    B_max and more get B_min (less breadth, and D_0 grows: more depth). D_0 is kept real-valued (the depth
    gate compares d(u) < D_0).
    """

    def __init__(
        self, window: int, target: float, eta_depth: float, eta_h: float, d_max: int, eta_l: float | None = None
    ):
        """Args: window: W; target: a*; eta_depth, eta_h, eta_l: step sizes (per unit acceptance error;
        eta_l None = tau_l constant); d_max: D_max (D_0's upper clip is D_max - 1)."""
        self.values: deque[float] = deque(maxlen=window)
        self.target = target
        self.eta_depth = eta_depth
        self.eta_h = eta_h
        self.eta_l = eta_l
        self.d_max = d_max

    @overload
    def update(
        self, accepted: int, drafted: int, d0: float, tau_h: float, tau_l: None = None
    ) -> tuple[float, float]: ...

    @overload
    def update(
        self, accepted: int, drafted: int, d0: float, tau_h: float, tau_l: float
    ) -> tuple[float, float, float]: ...

    def update(
        self, accepted: int, drafted: int, d0: float, tau_h: float, tau_l: float | None = None
    ) -> tuple[float, float] | tuple[float, float, float]:
        """Record one iteration and return the adapted (D_0, tau_h), or (D_0, tau_h, tau_l) when ``tau_l`` is
        given (moved only if ``eta_l`` is set); all unchanged if drafted == 0."""
        if drafted > 0:
            self.values.append(accepted / drafted)
            err = sum(self.values) / len(self.values) - self.target
            d0 = min(max(d0 + self.eta_depth * err, 1.0), self.d_max - 1.0)
            tau_h = min(max(tau_h - self.eta_h * err, 0.0), 1.0)
            if tau_l is not None and self.eta_l is not None:
                tau_l = min(max(tau_l - self.eta_l * err, 0.0), 1.0)
        return (d0, tau_h) if tau_l is None else (d0, tau_h, tau_l)


class DynaTreeParams(TreeParams):
    """DynaTree hyperparameters. Defaults: paper Appendix A where it gives them (D_0=5, D_max=8,
    (B_min, B_max)=(1, 3), (tau_h, tau_l)=(0.9, 0.4), N_max=256, tau=0.1 as the paper's fixed tree), and the
    paper's tree shape (tree_root=paper, prune=leaf, adapt_tau_l on: Algorithm 1). The constants the paper
    leaves unspecified (rho_stop, rho_deep, W, a*, eta_D, eta_h, eta_l, B_mid) are UNTUNED choices, documented
    per field: ``suites/dynatree-tuning.yaml`` (two values per constant around these defaults, WikiText-2
    articles held out from every benchmark suite, L_max=64, T=32, 3 prompts after warmup) was run once on the
    embedded SmolLM2 pair on a 2-core CPU shared with other jobs (OMP_NUM_THREADS=1). Its numbers do not
    support changing any default: only rho_stop changed the committed paths (0.05: L 4.04, mean tree 7.0
    nodes; 0.2: L 3.56, 4.3; 0.35: L 3.19, 3.1); every other setting committed exactly the same tokens per
    iteration as the defaults (L 3.56, 9.3 iterations), yet measured between 0.64x and 0.93x of AR, so the
    throughput ranking (best: rho_deep=0.7 at 0.93x, defaults 0.84x) is CPU contention, not the constants.
    Tune them on the machine you benchmark on (a GPU for the Pythia pair).

    Attributes:
        dynamic_breadth: use :func:`breadth_rule`; off = every node gets ``branching`` children.
        dynamic_depth: use :func:`depth_gate`; off = expand iff d(u) < D_0 (a fixed-depth tree).
        history_adaptation: adapt D_0 and tau_h online (:class:`HistoryController`); off = constant.
        adapt_tau_l: with history adaptation, adapt tau_l too (Algorithm 1 line 7 adjusts tau_l, tau_h, D_0);
            off = the section 3.3 example (D_0 and tau_h only).
        tree_root, prune: the tree shape (:class:`~dtbench.decoders.tree.TreeParams`; paper/leaf default).
        b_min, b_mid, b_max: branch bounds (paper: B_min=1, B_max=3; B_mid unspecified: we use 2, the only
            integer strictly between).
        branching: children per node when dynamic_breadth is off (2: the paper's Table 4 fixed tree).
        tau_h, tau_l: confidence thresholds on c(u) = max q_D(. | u) (paper: 0.9, 0.4).
        d0: base depth D_0 (paper: 5); d_max: hard maximum depth D_max (paper: 8).
        rho_stop: early stopping, no expansion below this path probability (unspecified: 0.2, above tau so
            it acts: leaves with tau <= p < rho_stop are verified but not expanded).
        rho_deep: expansion beyond D_0 only at path probability >= rho_deep (unspecified: 0.5, i.e. the path
            is more likely than not under the draft).
        window: W, iterations in the sliding acceptance window (unspecified: 8).
        node_acceptance: a*, the target of a_bar = mean accepted/drafted, a per-node ratio distinct from the
            reported ``acceptance_rate`` (accepted/depth); ``target_acceptance`` is accepted as its old name (unspecified: 0.35; accepted
            over *all* drafted nodes is well below 1 for any branching tree).
        eta_depth: eta_D, D_0 step per unit acceptance error (unspecified: 2.0, so a 0.1 error moves D_0 by
            0.2 per iteration).
        eta_h: eta_h, tau_h step per unit acceptance error (unspecified: 0.2).
        eta_l: eta_l, tau_l step per unit acceptance error (unspecified: 0.2, equal to eta_h, so the band
            [tau_l, tau_h) moves as a whole until one end is clipped).
    """

    dynamic_breadth: bool = Field(True, description="confidence-aware branching B(u) (paper 3.3)")
    dynamic_depth: bool = Field(True, description="depth gating with rho_stop / rho_deep / D_max (paper 3.3)")
    history_adaptation: bool = Field(True, description="adapt D_0 and tau_h from recent acceptance (paper 3.3)")
    adapt_tau_l: bool = Field(True, description="history adaptation also adjusts tau_l (Algorithm 1 line 7)")
    b_min: int = Field(1, ge=1, le=32, description="B_min, children of a confident node (c >= tau_h)")
    b_mid: int = Field(2, ge=1, le=32, description="B_mid, children when tau_l <= c < tau_h")
    b_max: int = Field(3, ge=1, le=32, description="B_max, children of an uncertain node (c < tau_l)")
    branching: int = Field(2, ge=1, le=32, description="fixed branching when dynamic_breadth is off")
    tau_h: float = Field(0.9, gt=0.0, lt=1.0, description="high confidence threshold tau_h")
    tau_l: float = Field(0.4, gt=0.0, lt=1.0, description="low confidence threshold tau_l")
    d0: int = Field(5, ge=1, le=63, description="base depth D_0")
    d_max: int = Field(8, ge=2, le=64, description="maximum depth D_max")
    rho_stop: float = Field(0.2, gt=0.0, lt=1.0, description="early-stopping path probability rho_stop")
    rho_deep: float = Field(0.5, gt=0.0, lt=1.0, description="deep-expansion path probability rho_deep")
    window: int = Field(8, ge=1, le=1024, description="history window W (iterations)")
    node_acceptance: float = Field(
        0.35,
        gt=0.0,
        lt=1.0,
        description="target node acceptance a* (accepted/drafted)",
        validation_alias=AliasChoices("node_acceptance", "target_acceptance"),
    )
    eta_depth: float = Field(2.0, gt=0.0, le=100.0, description="step size eta_D for D_0")
    eta_h: float = Field(0.2, gt=0.0, le=10.0, description="step size eta_h for tau_h")
    eta_l: float = Field(0.2, gt=0.0, le=10.0, description="step size eta_l for tau_l (when adapt_tau_l)")

    @model_validator(mode="after")
    def _check_orders(self) -> DynaTreeParams:
        if not self.tau_l < self.tau_h:
            raise ValueError(f"need tau_l < tau_h, got tau_l={self.tau_l}, tau_h={self.tau_h}")
        if not self.b_min <= self.b_mid <= self.b_max:
            raise ValueError(f"need b_min <= b_mid <= b_max, got {self.b_min}, {self.b_mid}, {self.b_max}")
        if not self.d0 < self.d_max:
            raise ValueError(f"need d0 < d_max, got d0={self.d0}, d_max={self.d_max}")
        if not self.rho_stop < self.rho_deep:
            raise ValueError(f"need rho_stop < rho_deep, got rho_stop={self.rho_stop}, rho_deep={self.rho_deep}")
        return self


class DynamicPolicy(ExpansionPolicy):
    """DynaTree's expansion policy; holds the adapted D_0, tau_h and tau_l (state of one generate() call).

    Attributes:
        d0: current base depth D_0 (float).
        tau_h: current high confidence threshold.
        tau_l: current low confidence threshold.
    """

    def __init__(self, params: DynaTreeParams):
        self.p = params
        self.d0 = float(params.d0)
        self.tau_h = params.tau_h
        self.tau_l = params.tau_l
        self.tau = params.tau
        self.n_max = resolved_n_max(params)
        self.max_breadth = params.b_max if params.dynamic_breadth else params.branching
        self.history = HistoryController(
            params.window,
            params.node_acceptance,
            params.eta_depth,
            params.eta_h,
            params.d_max,
            eta_l=params.eta_l if params.adapt_tau_l else None,
        )

    @property
    def depth_limit(self) -> int:
        return self.p.d_max if self.p.dynamic_depth else math.ceil(self.d0)

    def breadth(self, confidence: torch.Tensor) -> torch.Tensor:
        """(E,) float32 c(u) -> (E,) int64 B(u): :func:`breadth_rule`, or ``branching`` when switched off."""
        p = self.p
        if not p.dynamic_breadth:
            return torch.full(confidence.shape, p.branching, dtype=torch.long, device=confidence.device)
        return breadth_rule(confidence, self.tau_h, self.tau_l, p.b_min, p.b_mid, p.b_max)

    def expandable(self, depth: int, cum_logp: torch.Tensor) -> torch.Tensor:
        """:func:`depth_gate` with the current D_0, or d(u) < D_0 when dynamic depth is off."""
        p = self.p
        if not p.dynamic_depth:
            return torch.full(cum_logp.shape, depth < self.d0, dtype=torch.bool, device=cum_logp.device)
        return depth_gate(depth, cum_logp, self.d0, p.d_max, p.rho_stop, p.rho_deep)

    def observe(self, step: Step) -> None:
        """History adaptation after each verification (no-op when switched off)."""
        if self.p.history_adaptation:
            self.d0, self.tau_h, self.tau_l = self.history.update(
                step.accepted, step.drafted, self.d0, self.tau_h, self.tau_l
            )


class DynaTree(TreeDecoder[DynaTreeParams]):
    """DynaTree tree speculative decoder (paper section 3); lossless for greedy decoding."""

    Params = DynaTreeParams

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """The paper's defaults (Appendix A), and a small budget with drafting decided on the device."""
        return [
            {},
            {"n_max": 16, "tau": 0.0, "d0": 3, "d_max": 4, "rho_stop": 1e-4, "rho_deep": 1e-3, "resident": "full"},
        ]

    @classmethod
    def tree_bounds(cls, params: DynaTreeParams) -> tuple[int, int]:
        """(max(B_max, branching), D_max): the history controller moves D_0 below D_max, whichever rules are on."""
        return max(params.b_max, params.branching), params.d_max

    def make_policy(self) -> DynamicPolicy:
        return DynamicPolicy(self.params)
