"""Token trees as tensors, their attention masks and position ids, and greedy path selection (paper 3.3-3.5).

Part of the tree toolkit (:mod:`dtbench.decoders.tree` has the design and re-exports every name): the tree as
flattened BFS-ordered device tensors with its ancestor matrix, the tree attention mask in the format the model's
attention implementation needs, and SELECTCOMMIT's longest accepted path with the bonus token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dtbench.decoders.modelinfo import MaskKind, attention_mask_kind  # noqa: F401  (re-exported: issue 58 item 6)

CacheStrategy = Literal["compact", "rebuild"]
DraftStrategy = Literal["per_level", "per_node"]
TreeRoot = Literal["paper", "pending"]
Prune = Literal["leaf", "skip"]


def root_offset(tree_root: TreeRoot) -> int:
    """Internal depth of the node the paper calls depth 0: 1 for ``paper`` (u0 is the pending token's only
    child), 0 for ``pending`` (the pending token itself; its drafted children have depth 1).

    A drafted node at internal depth k (k drafted tokens on its root-to-node path, pending excluded) has depth
    ``k - root_offset(tree_root)`` in the convention the expansion rules (D, D_0, D_max) use.

    Raises:
        ValueError: for an unknown tree_root.
    """
    if tree_root == "paper":
        return 1
    if tree_root == "pending":
        return 0
    raise ValueError(f"unknown tree_root {tree_root!r}")


# ----------------------------------------------------------------------------------------------------------
# Tree structure
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One node of a token tree (paper 3.3), as plain Python values.

    Attributes:
        token: token id z_u.
        parent: index of the parent node pi(u) in BFS order, -1 for the root.
        depth: d(u), drafted tokens from the root (root: 0).
        logp: draft log-probability l_u = log p_D(z_u | ctx(pi(u))) (natural log; root: 0).
        cum_logp: cumulative log-probability of the root-to-u path, sum of l_v (root: 0); p(u) = exp(cum_logp).
    """

    token: int
    parent: int
    depth: int
    logp: float
    cum_logp: float


class TokenTree:
    """A token tree stored flattened in BFS order as preallocated device tensors (paper 3.3-3.4).

    Node 0 is the root (the pending token: last committed token, not yet in the target cache); nodes
    1..size-1 are drafted. Nodes are only ever appended level by level or parent by parent in first-in
    first-out order, so index order is a breadth-first order: every parent precedes its children and depths
    never decrease.

    Attributes (tensors of length ``capacity``, valid up to ``size``, on ``device``):
        tokens: int64 token ids.
        parents: int64 parent index; the root's entry is 0 (itself), so ``x[parents]`` gathers are safe.
        depths: int64 depth (root 0).
        logp: float32 draft log-probability of the node (root 0).
        cum_logp: float32 cumulative log-probability of the root-to-node path (root 0).
        anc: bool (capacity, capacity); ``anc[i, j]`` is True iff node j is an ancestor of node i or i itself.
        size: number of nodes including the root (host int).
        max_depth: deepest node's depth (host int; 0 for a root-only tree).
        n_max: node budget N_max on drafted nodes (size - 1 <= n_max).
    """

    def __init__(self, root_token: int, n_max: int, capacity: int, device: torch.device | str, spare: int = 0):
        """Create a tree holding only the root.

        Args:
            root_token: token id of the root (the pending token).
            n_max: budget of drafted nodes (paper N_max).
            capacity: preallocated number of node slots including the root (>= 1); more than n_max + 1 is
                never used.
            spare: slots allocated after the capacity that never hold a node (resident drafting writes the
                children that do not join there, :mod:`~dtbench.decoders.tree.resident`).

        Raises:
            ValueError: if capacity < 1 or n_max < 0.
        """
        if capacity < 1 or n_max < 0:
            raise ValueError(f"invalid tree capacity {capacity} / budget {n_max}")
        self.capacity = min(capacity, n_max + 1)
        self.n_max = n_max
        self.device = torch.device(device)
        c = self.capacity + spare
        self.tokens = torch.full((c,), int(root_token), dtype=torch.long, device=self.device)
        self.parents = torch.zeros(c, dtype=torch.long, device=self.device)
        self.depths = torch.zeros(c, dtype=torch.long, device=self.device)
        self.logp = torch.zeros(c, dtype=torch.float32, device=self.device)
        self.cum_logp = torch.zeros(c, dtype=torch.float32, device=self.device)
        self.anc = torch.zeros((c, c), dtype=torch.bool, device=self.device)
        self.anc[0, 0] = True
        self.size = 1
        self.max_depth = 0

    @property
    def n_drafted(self) -> int:
        """Number of drafted nodes (size - 1)."""
        return self.size - 1

    @property
    def budget_left(self) -> int:
        """How many more drafted nodes the budget N_max and the capacity allow."""
        return min(self.n_max - self.n_drafted, self.capacity - self.size)

    def add(
        self, parents: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, cum_logp: torch.Tensor, depth: int
    ) -> range:
        """Append k children, all at the same ``depth``, in the given (BFS) order.

        Args:
            parents: (k,) int64 parent indices (< size).
            tokens: (k,) int64 token ids.
            logp: (k,) float draft log-probabilities of the children.
            cum_logp: (k,) float cumulative log-probabilities (parent's cum_logp + logp).
            depth: the children's depth (parent depth + 1).

        Returns:
            The indices given to the new nodes (contiguous).

        Raises:
            ValueError: if the children do not fit in the budget.
        """
        k = int(parents.numel())
        if k > self.budget_left:
            raise ValueError(f"adding {k} nodes exceeds the tree budget ({self.budget_left} left)")
        s, e = self.size, self.size + k
        self.parents[s:e] = parents
        self.tokens[s:e] = tokens
        self.logp[s:e] = logp
        self.cum_logp[s:e] = cum_logp
        self.depths[s:e] = depth
        self.anc[s:e] = self.anc[parents]
        idx = torch.arange(s, e, device=self.device)
        self.anc[idx, idx] = True
        self.size = e
        self.max_depth = max(self.max_depth, depth)
        return range(s, e)

    def ancestors(self) -> torch.Tensor:
        """The (size, size) bool ancestor-or-self matrix of the valid nodes (a view)."""
        return self.anc[: self.size, : self.size]

    def nodes(self) -> list[TreeNode]:
        """The valid nodes as :class:`TreeNode` values, in BFS order (one device-to-host copy)."""
        n = self.size
        toks, pars, deps = (t[:n].tolist() for t in (self.tokens, self.parents, self.depths))
        lps, cums = self.logp[:n].tolist(), self.cum_logp[:n].tolist()
        return [TreeNode(toks[i], pars[i] if i else -1, deps[i], lps[i], cums[i]) for i in range(n)]


def tree_capacity(max_breadth: int, depth_cap: int, n_max: int) -> int:
    """Node slots (root included) a tree can need: min(N_max, sum_{d=1..depth_cap} max_breadth^d) + 1."""
    total, width = 0, 1
    for _ in range(max(depth_cap, 0)):
        width *= max_breadth
        total += width
        if total >= n_max:
            return n_max + 1
    return total + 1


def tree_node_bound(first: int, max_breadth: int, depth_cap: int, n_max: int) -> int:
    """The most nodes (root included) a drafted tree can hold, exactly: at most ``first`` nodes at depth 1 (1: a
    paper-rooted tree's u0; else the root's largest breadth), ``max_breadth`` times more at each further depth up to
    ``depth_cap``, and never more than N_max drafted: 1 + min(N_max, sum_{d=1..depth_cap} first x B^(d-1))."""
    total, width = 0, first
    for _ in range(max(depth_cap, 0)):
        total += width
        if total >= n_max:
            return n_max + 1
        width *= max_breadth
    return total + 1


def bfs_order(parents: Sequence[int]) -> list[int]:
    """Breadth-first flattening of an arbitrary tree (paper 3.4, BFSFLATTEN of Algorithm 1).

    Args:
        parents: ``parents[i]`` is the parent of node i, -1 for the (single) root; any numbering.

    Returns:
        A permutation of range(len(parents)) starting at the root, listing each depth level before the
        next, children of a node in increasing index order: every parent precedes its children.

    Raises:
        ValueError: if there is not exactly one root, or a node is unreachable from it (a cycle).
    """
    n = len(parents)
    roots = [i for i, p in enumerate(parents) if p < 0]
    if len(roots) != 1:
        raise ValueError(f"a tree needs exactly one root (parent -1), got {len(roots)}")
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    order, queue = [], deque(roots)
    while queue:
        u = queue.popleft()
        order.append(u)
        queue.extend(children[u])
    if len(order) != n:
        raise ValueError("parents do not form a tree rooted at the single root")
    return order


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self relation of a BFS-ordered tree, by pointer jumping (tensor ops, one per level).

    Args:
        parents: (n,) int64, ``parents[i] < i`` for i > 0; ``parents[0]`` (the root) is ignored.

    Returns:
        (n, n) bool, ``A[i, j]`` True iff j is i or an ancestor of i. Equals :attr:`TokenTree.anc`.
    """
    n = parents.numel()
    par = parents.clone()
    par[0] = 0
    rows = torch.arange(n, device=parents.device)
    anc = torch.zeros((n, n), dtype=torch.bool, device=parents.device)
    idx = rows.clone()
    for _ in range(n):
        anc[rows, idx] = True
        nxt = par[idx]
        if torch.equal(nxt, idx):
            break
        idx = nxt
    return anc


# ----------------------------------------------------------------------------------------------------------
# Masks and positions
# ----------------------------------------------------------------------------------------------------------


def tree_attention_mask(
    ancestors: torch.Tensor, prefix_len: int, kind: MaskKind, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The tree attention mask A of paper 3.4, ready to pass as a 4D ``attention_mask``.

    Row i is a tree node fed in this forward; it attends to all ``prefix_len`` cached positions and, among
    the tree positions that follow them, exactly to those whose column is True in ``ancestors`` (its
    ancestors and itself).

    Args:
        ancestors: (q, k) bool; ``ancestors[i, j]`` True iff the j-th tree position after the prefix is an
            ancestor of (or is) the i-th query node.
        prefix_len: number of prefix positions every node sees (the cache length before the tree).
        kind: "bool" (True = attend, for sdpa) or "additive" (0 / finfo(dtype).min, for eager).
        dtype: the model's floating dtype, for the additive form.

    Returns:
        (1, 1, q, prefix_len + k): bool, or ``dtype`` additive.
    """
    q, k = ancestors.shape
    if kind == "bool":
        mask = torch.ones((q, prefix_len + k), dtype=torch.bool, device=ancestors.device)
        mask[:, prefix_len:] = ancestors
    else:
        mask = torch.zeros((q, prefix_len + k), dtype=dtype, device=ancestors.device)
        mask[:, prefix_len:].masked_fill_(~ancestors, torch.finfo(dtype).min)
    return mask[None, None]


@dataclass(frozen=True, slots=True)
class SideBranch:
    """Tokens that ride in a tree's verification forward without being verified (e.g. Lookahead's Jacobi window).

    Fed after the tree nodes in the same target forward. Every side token attends to the prefix, to the tree's
    root (the pending token) and to the side tokens ``attends`` allows; no tree node attends to a side token and
    no side token to a drafted node, so the tree's logits are exactly those of the tree alone. Their logits go
    back to the drafter (:meth:`~dtbench.decoders.tree.draft.TreeDrafter.feed_logits`); their KV entries are
    dropped with the rejected nodes (``compact``) or the crop (``rebuild``).

    Attributes:
        tokens: (m,) int64 token ids.
        offsets: (m,) int64 position of each token relative to the root's position (>= 1).
        attends: (m, m) bool, ``attends[i, j]`` True iff side token i attends to side token j (i itself included).
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    attends: torch.Tensor

    @property
    def size(self) -> int:
        """m, the number of side tokens."""
        return int(self.tokens.numel())


def with_side_branch(ancestors: torch.Tensor, side: SideBranch) -> torch.Tensor:
    """The (n + m, n + m) bool attention relation of a tree (``ancestors``, (n, n)) followed by a side branch.

    Block-diagonal except column 0: side tokens also see the root. Pass it to :func:`tree_attention_mask`.
    """
    n, m = ancestors.shape[0], side.size
    rel = torch.zeros((n + m, n + m), dtype=torch.bool, device=ancestors.device)
    rel[:n, :n] = ancestors
    rel[n:, 0] = True
    rel[n:, n:] = side.attends.to(ancestors.device)
    return rel


def tree_position_ids(depths: torch.Tensor, offset: int) -> torch.Tensor:
    """Position ids of tree nodes: offset + depth (paper 3.4; ``offset`` = position of the root).

    Args:
        depths: (n,) int64 node depths.
        offset: position id of depth 0 (the prefix length when the root is the first fed token).

    Returns:
        (1, n) int64.
    """
    return (depths + offset).unsqueeze(0)


# ----------------------------------------------------------------------------------------------------------
# Greedy path selection (paper 3.5, SELECTCOMMIT)
# ----------------------------------------------------------------------------------------------------------


def select_path(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, pred: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Longest greedy-consistent root-to-node path plus the bonus token (paper 3.5).

    A drafted node u is consistent iff its token equals the target's greedy prediction at its parent,
    ``tokens[u] == pred[parents[u]]``, and so are all its drafted ancestors. The committed path ends at the
    deepest consistent node (ties: the first in BFS order; siblings drafted by top-k have distinct tokens,
    so there is no tie in practice); the bonus token is ``pred`` at that node. With no consistent child of
    the root this is the one-token fallback: commit ``pred[0]`` (the target's greedy token after the prefix).

    Args:
        tokens, parents, depths: (n,) int64 of a BFS-ordered tree, node 0 the root (``parents[0]`` ignored).
        ancestors: (n, n) bool ancestor-or-self matrix.
        pred: (n,) int64 target argmax at every node (``pred[u]`` = greedy next token after the path to u).

    Returns:
        (path, committed): path = node indices root first (root included, increasing depth); committed =
        the path's drafted tokens (root excluded) followed by the bonus token; len(committed) = len(path).
    """
    matched = tokens == pred[parents]
    matched[0] = True
    consistent = ~(ancestors & ~matched.unsqueeze(0)).any(dim=1)
    end = torch.argmax(torch.where(consistent, depths, -1))  # first maximum
    packed = torch.cat([torch.where(ancestors[end], tokens, -1), pred[end].view(1)]).tolist()
    path = [i for i, t in enumerate(packed[:-1]) if t >= 0]
    return path, [packed[i] for i in path[1:]] + [packed[-1]]
