"""The token-tree toolkit shared by every tree speculative decoder (``fixed_tree``, ``dynatree``, ...).

One implementation of each piece of paper sections 3.3-3.5 and Appendix D (Algorithm 1), used by all tree
decoders; a decoder only supplies an :class:`ExpansionPolicy` (which nodes to expand, with how many children):

- :class:`TokenTree`: the nodes (token, parent, depth, draft log-prob, cumulative log-prob; paper 3.3) as
  device tensors, stored flattened in breadth-first order (paper 3.4), plus the ancestor matrix.
- :func:`bfs_order`, :func:`ancestor_matrix`: the flattening and the ancestor relation for arbitrary trees.
- :func:`tree_attention_mask`, :func:`attention_mask_kind`, :func:`tree_position_ids`: the tree attention
  mask of paper 3.4 in the format the model's attention implementation needs, and the position ids.
- :func:`select_path`: greedy longest-path selection with the bonus token and the one-token fallback (3.5).
- :class:`DraftSession` and :func:`draft_tree`: tree drafting with a single draft KV cache (Algorithm 1,
  DRAFTTREE), either one draft forward per expanded node (``per_node``, the paper) or one per tree level
  (``per_level``).
- :func:`speculate_tree`: the verification driver (draft tree -> verify in one target forward -> select
  path -> update target and draft caches), with the two cache strategies ``compact`` and ``rebuild``.
- :class:`TreeParams`, :class:`TreeDecoder`: the params and the Decoder base both tree decoders subclass.

Design. Node 0 of every tree is the *pending* token: the newest committed token, which the target cache does
not hold yet (the invariant of ``ar`` and ``linear``). Drafted nodes are its descendants at depth >= 1. The
verification forward feeds [root, drafted nodes] with the tree mask, so its logits at the root are the
paper's prefix logits ``s_last`` and its logits at node u are ``s(u)``; the bonus token becomes the root of the
next tree. Consequences:

- ``compact``: ONE target forward per iteration. The root and the accepted path already sit in the target
  cache (computed under the tree mask, i.e. with exactly their sequential context), so ``kv.keep`` keeps
  them by index and drops the rest.
- ``rebuild`` (the paper's 3.5 / Algorithm 1 line 6): crop the target cache back to the prefix and re-run
  the committed tokens [root, path]: two target forwards per iteration.
- The paper's tree is rooted at the draft's top-1 token u0 (Algorithm 1 line 10), i.e. its first drafted
  level has a single node. Here the first drafted level is chosen by the same expansion rule as every other
  level (the root is expanded like any node), which contains the paper's tree as the special case B(root)=1.
  Depths count drafted tokens: a drafted node at depth d is the d-th token after the pending one, so a chain
  of depth K is exactly linear speculation with K drafts.
- Pruning (3.3, "prune any leaf u with p(u) < tau") is applied when a child is created: p is non-increasing
  along a path, so a node below tau can only root a subtree below tau, and iterated leaf pruning removes all
  of it; not creating it is the same tree without the wasted verification.
- The draft cache holds the committed prefix (root included) and then the expanded tree nodes in the order
  they were fed; after verification it keeps the accepted path's expanded nodes by index too (no draft
  recomputation). Path nodes that were leaves (never fed to the draft) are fed at the next iteration's root
  forward together with the new root.

Host/device synchronisation: one ``tolist()`` per expansion step (per level or per node) and one per
verification; masks, position ids, the ancestor matrix and path selection are tensor operations.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field

from dtbench.decoders import kv
from dtbench.decoders.base import Decoder, DecoderParams, Step

CacheStrategy = Literal["compact", "rebuild"]
DraftStrategy = Literal["per_level", "per_node"]
MaskKind = Literal["bool", "additive"]

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

    def __init__(self, root_token: int, n_max: int, capacity: int, device: torch.device | str):
        """Create a tree holding only the root.

        Args:
            root_token: token id of the root (the pending token).
            n_max: budget of drafted nodes (paper N_max).
            capacity: preallocated number of node slots including the root (>= 1); more than n_max + 1 is
                never used.

        Raises:
            ValueError: if capacity < 1 or n_max < 0.
        """
        if capacity < 1 or n_max < 0:
            raise ValueError(f"invalid tree capacity {capacity} / budget {n_max}")
        self.capacity = min(capacity, n_max + 1)
        self.n_max = n_max
        self.device = torch.device(device)
        c = self.capacity
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

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, cum_logp: torch.Tensor,
            depth: int) -> range:
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


def attention_mask_kind(model: torch.nn.Module) -> MaskKind:
    """The 4D-mask format ``model``'s attention implementation needs (transformers 5.x uses it as-is).

    Returns:
        "additive" for ``eager`` (it adds the mask to the scores: 0 where allowed, dtype-min elsewhere);
        "bool" for ``sdpa`` (True = attend).

    Raises:
        ValueError: for any other implementation (flash_attention_2/3, flex_attention, ...): they accept only
            causal/padding masks and cannot express a tree.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl == "eager":
        return "additive"
    if impl == "sdpa":
        return "bool"
    raise ValueError(
        f"tree attention needs an explicit 4D attention mask, which attention implementation {impl!r} cannot "
        "take; load the model with attn_implementation='sdpa' or 'eager'"
    )


def tree_attention_mask(ancestors: torch.Tensor, prefix_len: int, kind: MaskKind,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
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


def select_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                pred: torch.Tensor) -> tuple[list[int], list[int]]:
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


# ----------------------------------------------------------------------------------------------------------
# Expansion policies and drafting (paper 3.3, Algorithm 1 DRAFTTREE)
# ----------------------------------------------------------------------------------------------------------


class ExpansionPolicy(ABC):
    """Which tree nodes to expand and with how many children: the only part a tree decoder supplies.

    Attributes:
        max_breadth: upper bound of :meth:`breadth` (the top-k width computed per expanded node).
        n_max: node budget N_max on drafted nodes (paper 3.3).
        tau: pruning threshold on cumulative path probability p(u) (paper 3.3); 0 disables pruning.

    One policy object lives for one ``generate()`` call, so any adaptive state resets per prompt.
    """

    max_breadth: int
    n_max: int
    tau: float

    @property
    def log_tau(self) -> float:
        """log(tau), -inf when tau is 0."""
        return math.log(self.tau) if self.tau > 0 else -math.inf

    @property
    @abstractmethod
    def depth_limit(self) -> int:
        """Hard maximum depth of drafted nodes in the next tree (>= 1)."""

    @abstractmethod
    def breadth(self, confidence: torch.Tensor) -> torch.Tensor:
        """Children per expanded node B(u).

        Args:
            confidence: (E,) float32, c(u) = max_v q_D(v | u) of each expanded node (a probability).

        Returns:
            (E,) int64 in [1, max_breadth].
        """

    @abstractmethod
    def expandable(self, depth: int, cum_logp: torch.Tensor) -> torch.Tensor:
        """Whether nodes at ``depth`` with cumulative log-probabilities ``cum_logp`` may be expanded.

        Args:
            depth: the nodes' depth d(u) (all the same).
            cum_logp: float32 tensor of any shape, log p(u).

        Returns:
            bool tensor shaped like ``cum_logp``.
        """

    def observe(self, step: Step) -> None:
        """Feedback after each verification (history adaptation); no-op by default."""


class DraftSession:
    """The draft model and its single KV cache across iterations (Appendix D, cache reuse).

    Between iterations the cache holds committed tokens except ``backlog`` (committed tokens not yet fed)
    and the pending root. During drafting it holds the committed prefix including the root (``prefix_len``
    positions) followed by the expanded tree nodes in the order fed (``fed``), each computed with the tree
    mask, so a node's KV equals what sequential decoding along its root-to-node path would produce.

    Attributes:
        model: the draft causal LM.
        cache: its ``DynamicCache``.
        backlog: committed token ids not yet in the cache (the next root excluded).
        prefix_len: cache positions holding committed tokens during this iteration's drafting.
        fed: tree node indices whose KV follows the prefix, in cache order.
        forwards: draft forward passes run (for accounting).
    """

    def __init__(self, model: torch.nn.Module, prompt: Sequence[int]):
        """Args: model: the draft causal LM; prompt: the prompt token ids (fed lazily on the first root).

        Raises:
            ValueError: if the draft's attention implementation cannot take a tree mask.
        """
        self.model = model
        self.cache = kv.new_cache()
        self.backlog: list[int] = list(prompt)
        self.kind = attention_mask_kind(model)
        self.dtype = model.dtype
        self.device = model.device
        self.prefix_len = 0
        self.fed: list[int] = []
        self._fed_t = torch.empty(0, dtype=torch.long, device=self.device)
        self.started = False
        self.forwards = 0

    def start(self, root: int) -> torch.Tensor:
        """Feed the backlog and the root causally; return q_D(. | root) logits, shape (1, vocab)."""
        logits = kv.forward(self.model, self.backlog + [root], self.cache, last_only=True)
        self.forwards += 1
        self.backlog = []
        self.prefix_len = kv.cache_len(self.cache)
        self.fed = []
        self._fed_t = torch.empty(0, dtype=torch.long, device=self.device)
        self.started = True
        return logits

    def feed(self, tree: TokenTree, nodes: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over tree ``nodes`` (all at ``depth``) with the tree mask.

        Each node attends to the committed prefix (root included) and to its fed ancestors and itself; its
        position id is (root position) + depth.

        Returns:
            (logits (len(nodes), vocab) in the draft's dtype, nodes as an int64 device tensor).
        """
        nodes_t = torch.tensor(nodes, dtype=torch.long, device=self.device)
        cols = torch.cat([self._fed_t, nodes_t])
        mask = tree_attention_mask(tree.anc[nodes_t][:, cols], self.prefix_len, self.kind, self.dtype)
        pos = torch.full((1, len(nodes)), self.prefix_len - 1 + depth, dtype=torch.long, device=self.device)
        logits = kv.forward(self.model, tree.tokens[nodes_t].unsqueeze(0), self.cache, position_ids=pos,
                            attention_mask=mask)
        self.forwards += 1
        self.fed.extend(nodes)
        self._fed_t = cols
        return logits, nodes_t

    def commit(self, root: int, path: list[int], committed: list[int]) -> None:
        """Keep only the committed path in the draft cache (``kv.keep``), backlog the rest.

        Args:
            root: this iteration's root token.
            path: committed node indices, root first (from :func:`select_path`).
            committed: committed tokens (path tokens without the root, then the bonus token).
        """
        path_tokens = committed[:-1]
        if not self.started:
            self.backlog += [root, *path_tokens]
            return
        pos = {u: self.prefix_len + j for j, u in enumerate(self.fed)}
        keep: list[int] = []
        for u in path[1:]:
            if u not in pos:  # expanded nodes are ancestor-closed: the rest of the path was never fed
                break
            keep.append(pos[u])
        kv.keep(self.cache, self.prefix_len, keep)
        self.backlog = path_tokens[len(keep):]
        self.started = False


def _expand(tree: TokenTree, parents_t: torch.Tensor, parent_depth: int, logits: torch.Tensor,
            policy: ExpansionPolicy, depth_cap: int) -> list[int]:
    """Add the children of the expanded nodes ``parents_t`` (all at ``parent_depth``) from their draft logits.

    Per parent: the B(u) = policy.breadth(c(u)) most probable tokens, dropping those with p < tau (pruning),
    in parent order then probability order, until the node budget is reached (Algorithm 1 lines 26-28).

    Returns:
        The new nodes that are themselves expandable (depth < depth_cap and policy.expandable), in BFS order.
    """
    budget = tree.budget_left
    if budget <= 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = min(policy.max_breadth, lp.shape[-1])
    top_lp, top_tok = lp.topk(k, dim=-1)  # (E, k), sorted by probability
    breadth = policy.breadth(top_lp[:, 0].exp())
    cum = tree.cum_logp[parents_t].unsqueeze(1) + top_lp
    keep = (torch.arange(k, device=lp.device).unsqueeze(0) < breadth.unsqueeze(1)) & (cum >= policy.log_tau)
    depth = parent_depth + 1
    codes = keep.to(torch.uint8)
    if depth < depth_cap:
        codes = codes | (policy.expandable(depth, cum) & keep).to(torch.uint8) << 1
    flat = codes.flatten().tolist()
    sel = [i for i, c in enumerate(flat) if c][:budget]
    if not sel:
        return []
    sel_t = torch.tensor(sel, dtype=torch.long, device=lp.device)
    new = tree.add(parents_t[sel_t // k], top_tok.flatten()[sel_t], top_lp.flatten()[sel_t],
                   cum.flatten()[sel_t], depth)
    return [new[j] for j, i in enumerate(sel) if flat[i] & 2]


def draft_tree(session: DraftSession, tree: TokenTree, root: int, policy: ExpansionPolicy, depth_cap: int,
               strategy: DraftStrategy) -> None:
    """Grow ``tree`` (holding only its root) with the draft model (Algorithm 1, DRAFTTREE).

    The root (p = 1, depth 0) passes every gating rule and is always expanded; its draft logits come from
    ``session.start`` (which also feeds any backlog). Children are created by :func:`_expand`.

    Args:
        session: the draft model and cache.
        tree: a root-only tree; filled in place, in BFS order.
        root: the root's token id (host int, equal to ``tree.tokens[0]``).
        policy: breadth, depth gating, pruning and budget.
        depth_cap: no drafted node deeper than this (>= 1; the driver caps it to the tokens still needed).
        strategy: "per_node" = one cached draft step per expanded node, first-in first-out (the paper);
            "per_level" = one draft forward per depth over all expandable nodes of that level. Both build the
            same tree (same node order) given the same draft logits.

    Raises:
        ValueError: for an unknown strategy.
    """
    if strategy not in ("per_level", "per_node"):
        raise ValueError(f"unknown draft strategy {strategy!r}")
    logits = session.start(root)
    root_t = torch.zeros(1, dtype=torch.long, device=tree.device)
    frontier = _expand(tree, root_t, 0, logits, policy, depth_cap)
    if strategy == "per_level":
        depth = 1
        while frontier and tree.budget_left > 0:
            logits, nodes_t = session.feed(tree, frontier, depth)
            frontier = _expand(tree, nodes_t, depth, logits, policy, depth_cap)
            depth += 1
    else:
        queue = deque((u, 1) for u in frontier)
        while queue and tree.budget_left > 0:
            u, depth = queue.popleft()
            logits, nodes_t = session.feed(tree, [u], depth)
            queue.extend((v, depth + 1) for v in _expand(tree, nodes_t, depth, logits, policy, depth_cap))


# ----------------------------------------------------------------------------------------------------------
# Verification driver (Algorithm 1, one iteration; paper 3.4-3.5)
# ----------------------------------------------------------------------------------------------------------


def verify_tree(target: torch.nn.Module, cache, tree: TokenTree, kind: MaskKind) -> torch.Tensor:
    """One target forward over [root, drafted nodes] with the tree mask (Algorithm 1 line 4).

    Args:
        target: the target causal LM; ``cache`` holds the committed prefix without the root.
        tree: the drafted tree.
        kind: the target's mask format (:func:`attention_mask_kind`).

    Returns:
        (size,) int64 greedy predictions: entry u is argmax p_T(. | prefix, path to u); entry 0 is the
        paper's y_hat_{t+1} (argmax of the prefix logits s_last). The cache grows by ``size`` positions.
    """
    n = tree.size
    prefix_len = kv.cache_len(cache)
    dev = target.device
    tokens = tree.tokens[:n].to(dev).unsqueeze(0)
    if n == 1:  # root only: a plain causal step
        logits = kv.forward(target, tokens, cache)
    else:
        mask = tree_attention_mask(tree.ancestors().to(dev), prefix_len, kind, target.dtype)
        logits = kv.forward(target, tokens, cache, position_ids=tree_position_ids(tree.depths[:n].to(dev), prefix_len),
                            attention_mask=mask)
    return torch.argmax(logits, dim=-1).to(tree.device)


def speculate_tree(target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                   policy: ExpansionPolicy, cache_strategy: CacheStrategy = "compact",
                   draft_strategy: DraftStrategy = "per_level") -> Iterator[Step]:
    """Greedy tree speculative decoding: the loop every tree decoder runs (Algorithm 1, repeated).

    Invariant between iterations: the target cache holds every committed token except the newest
    (``pending``, the next tree's root); the draft session holds them minus its backlog. Each iteration:
    draft a tree rooted at ``pending`` (depth capped so no more than the remaining tokens are drafted) ->
    one target forward over the tree with the tree mask -> :func:`select_path` -> update the target cache
    (``compact``: ``kv.keep`` the root and the path by index; ``rebuild``: crop to the prefix and re-run
    [root, path], a second target forward) -> keep the path in the draft cache -> ``policy.observe``.

    Args:
        target, draft: causal LMs sharing a vocabulary; attention implementation sdpa or eager.
        input_ids: (1, prompt_len) int64 prompt.
        max_new_tokens: T >= 1.
        policy: a fresh expansion policy (its state is this call's state).
        cache_strategy: "compact" (1 target forward per iteration) or "rebuild" (2, the paper's).
        draft_strategy: "per_level" or "per_node" (see :func:`draft_tree`).

    Yields:
        First the prefill's token as a Step (TTFT); then one Step per iteration with tokens = committed path
        tokens + bonus, drafted = tree_size = drafted nodes, accepted = committed path length before the
        bonus, depth = deepest drafted node (the runner counts forwards: 1 target forward per iteration with
        compact, 2 with rebuild).

    Raises:
        ValueError: unknown strategy, or a model whose attention implementation cannot take a tree mask.
    """
    if cache_strategy not in ("compact", "rebuild"):
        raise ValueError(f"unknown cache strategy {cache_strategy!r}")
    if draft_strategy not in ("per_level", "per_node"):
        raise ValueError(f"unknown draft strategy {draft_strategy!r}")
    t_kind = attention_mask_kind(target)
    session = DraftSession(draft, input_ids[0].tolist())
    t_cache, logits = kv.prefill(target, input_ids)
    pending = int(torch.argmax(logits).item())
    yield Step(tokens=(pending,))
    produced = 1
    while produced < max_new_tokens:
        depth_cap = min(policy.depth_limit, max_new_tokens - produced - 1)
        tree = TokenTree(pending, policy.n_max, tree_capacity(policy.max_breadth, depth_cap, policy.n_max),
                         session.device)
        if depth_cap >= 1:
            draft_tree(session, tree, pending, policy, depth_cap, draft_strategy)
        prefix_len = kv.cache_len(t_cache)
        pred = verify_tree(target, t_cache, tree, t_kind)
        n = tree.size
        path, committed = select_path(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred)
        if cache_strategy == "compact":
            kv.keep(t_cache, prefix_len, [prefix_len + u for u in path])
        else:
            kv.crop(t_cache, prefix_len)
            kv.forward(target, [pending, *committed[:-1]], t_cache, last_only=True)
        session.commit(pending, path, committed)
        step = Step(tokens=tuple(committed), drafted=tree.n_drafted, accepted=len(committed) - 1,
                    tree_size=tree.n_drafted, depth=tree.max_depth)
        policy.observe(step)
        pending = committed[-1]
        produced += len(committed)
        yield step


class TreeParams(DecoderParams):
    """Hyperparameters every tree decoder shares.

    Attributes:
        cache_strategy: "compact" keeps the accepted path's target KV entries by index (one target forward
            per iteration); "rebuild" is the paper's crop-and-re-run (section 3.5; two target forwards).
        draft_strategy: "per_level" drafts a whole tree level in one draft forward with the tree mask;
            "per_node" runs one cached draft step per expanded node (the paper's Algorithm 1).
        tau: pruning threshold on cumulative draft path probability p(u) (paper 3.3; Table 1 uses 0.1);
            0 disables pruning.
        n_max: node budget N_max, drafted nodes per tree (paper Appendix A: 256). ``"auto"`` (an extension, not
            the paper's default): the runner sets it before the first cell to the largest calibrated n whose
            tree verification (root + n nodes, one target forward) costs at most ``n_max_factor`` x one AR token
            (:func:`dtbench.harness.calibrate.auto_budget`); the chosen value is stored in the cell's params.
        n_max_factor: the factor of ``n_max: "auto"`` (default 2.0); unused otherwise.

    The default strategies (compact, per_level) are the fastest lossless combination measured by
    ``bench/tree_strategies.py`` on the embedded SmolLM2 pair (CPU); they also run the fewest forwards
    (1 target forward per iteration, one draft forward per tree level), which matters more on a GPU.
    """

    cache_strategy: CacheStrategy = Field(
        "compact", description="target cache update: 'compact' (keep path KV, 1 forward) or 'rebuild' (paper, 2)")
    draft_strategy: DraftStrategy = Field(
        "per_level", description="'per_level' (one draft forward per depth) or 'per_node' (paper, one per node)")
    tau: float = Field(0.1, ge=0.0, lt=1.0, description="pruning threshold on cumulative path probability p(u)")
    n_max: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        256, description="node budget N_max (drafted nodes per tree); 'auto': chosen by the runner from "
        "the calibrated verify curve (harness/calibrate.py auto_budget; an extension, not the paper's)")
    n_max_factor: float = Field(2.0, gt=1.0, le=1000.0, description="n_max: auto takes the largest n whose tree "
                                "verify costs at most this many times one AR token")


class TreeDecoder(Decoder):
    """Base of the tree speculative decoders: subclasses only build their :class:`ExpansionPolicy`.

    Lossless for greedy decoding (paper 3.6): the committed tokens equal the target's greedy tokens.
    """

    Params: ClassVar[type[DecoderParams]] = TreeParams
    needs_draft = True
    lossless = True

    @abstractmethod
    def make_policy(self) -> ExpansionPolicy:
        """A fresh expansion policy for one generate() call (adaptive state starts from the params)."""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Run :func:`speculate_tree` with this decoder's policy and strategies (see there for the Steps)."""
        yield from speculate_tree(self.target, self.draft, input_ids, max_new_tokens, self.make_policy(),
                                  self.params.cache_strategy, self.params.draft_strategy)
