"""Fixed-tree speculative decoding: the static tree baseline of the paper (section 4.3, "Fixed Tree").

Every node above depth D gets the B most probable draft children, children whose cumulative draft path
probability falls below tau are pruned, and the tree stops growing at N_max drafted nodes (breadth-first,
so shallow nodes win the budget). Drafting, verification, path selection and cache updates are the shared
toolkit's (:mod:`dtbench.decoders.tree`).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from dtbench.decoders.tree import ExpansionPolicy, TreeDecoder, TreeParams, resolved_n_max


class FixedTreeParams(TreeParams):
    """Hyperparameters of the fixed tree (paper Table 1: D=8, B=3, tau=0.1, N_max=256; Table 4: D=5, B=2).

    Attributes:
        depth: D, depth of the deepest drafted node. With ``tree_root: paper`` it counts from u0 (depth 0,
            Algorithm 1 line 10), so a path holds up to D + 1 drafted tokens; with ``tree_root: pending`` it
            counts drafted tokens, and a tree with branching 1 is linear speculation with K = D.
        branching: B, children per expanded node (the B most probable draft tokens).
        tree_root, prune, tau, n_max, cache_strategy, draft_strategy: see
            :class:`~dtbench.decoders.tree.TreeParams`.
    """

    depth: int = Field(
        8,
        ge=1,
        le=64,
        description="tree depth D (from u0 at depth 0 with tree_root=paper; "
        "drafted tokens on the longest path with tree_root=pending)",
    )
    branching: int = Field(3, ge=1, le=32, description="branching factor B (children per expanded node)")


class FixedPolicy(ExpansionPolicy):
    """Static expansion: B(u) = B for every node; a node is expandable iff d(u) < D (plus pruning/budget);
    d(u) in the tree shape's convention (the toolkit converts).

    Stateless, so ``observe`` is the inherited no-op.
    """

    def __init__(self, depth: int, branching: int, tau: float, n_max: int):
        """Args: depth: D >= 1; branching: B >= 1; tau: pruning threshold in [0, 1); n_max: N_max >= 1."""
        self.depth = depth
        self.max_breadth = branching
        self.tau = tau
        self.n_max = n_max

    @property
    def depth_limit(self) -> int:
        return self.depth

    def breadth(self, confidence: torch.Tensor) -> torch.Tensor:
        """(E,) float32 confidences -> (E,) int64 all equal to B."""
        return torch.full(confidence.shape, self.max_breadth, dtype=torch.long, device=confidence.device)

    def expandable(self, depth: int, cum_logp: torch.Tensor) -> torch.Tensor:
        """d(u) < D, broadcast to ``cum_logp``'s shape (bool)."""
        return torch.full(cum_logp.shape, depth < self.depth, dtype=torch.bool, device=cum_logp.device)


class FixedTree(TreeDecoder[FixedTreeParams]):
    """Static tree speculative decoder (depth D, branching B, pruning tau, budget N_max); lossless."""

    Params = FixedTreeParams

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """D = 3, B = 2 with the compact and the paper's rebuild cache, per-level and per-node drafting, resident."""
        return [
            {"depth": 3, "branching": 2},
            {"depth": 3, "branching": 2, "cache_strategy": "rebuild"},
            {"depth": 3, "branching": 2, "draft_strategy": "per_node"},
            {"depth": 3, "branching": 2, "tau": 0.0, "resident": "full"},
        ]

    @classmethod
    def tree_bounds(cls, params: FixedTreeParams) -> tuple[int, int]:
        """(B, D)."""
        return params.branching, params.depth

    def make_policy(self) -> FixedPolicy:
        p = self.params
        return FixedPolicy(p.depth, p.branching, p.tau, resolved_n_max(p))
