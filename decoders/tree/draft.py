"""Tree drafting: expansion policies, the draft session and DRAFTTREE (paper 3.3, Algorithm 1).

Part of the tree toolkit (:mod:`dtbench.decoders.tree` has the design and re-exports every name): a decoder
supplies an :class:`ExpansionPolicy`; :func:`draft_tree` grows the tree level by level (``per_level``) or node by
node (``per_node``, the paper's) with one draft KV cache (:class:`DraftSession`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dtbench.decoders import kv, modelinfo
from dtbench.decoders.base import Step
from dtbench.decoders.sampling import SamplingSettings, sample_without_replacement
from dtbench.decoders.tree.structure import (
    DraftStrategy,
    Prune,
    SideBranch,
    TokenTree,
    TreeRoot,
    attention_mask_kind,
    root_offset,
    tree_attention_mask,
)

# ----------------------------------------------------------------------------------------------------------
# Expansion policies and drafting (paper 3.3, Algorithm 1 DRAFTTREE)
# ----------------------------------------------------------------------------------------------------------


SKIP_WITH_SAMPLING = (
    "prune: skip drops drafted children by their sampled value, which would bias speculative "
    "sampling; use prune: leaf (the paper's, Algorithm 1) with sampling"
)


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
        """Hard maximum depth of drafted nodes in the next tree, in the policy's depth convention (>= 1 for a
        pending-rooted tree, >= 0 for a paper-rooted one; the driver adds :func:`root_offset`)."""

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
            depth: the nodes' depth d(u) (all the same), in the tree shape's convention: u0 of a paper tree
                has depth 0, the first drafted level of a pending tree depth 1.
            cum_logp: float32 tensor of any shape, log p(u).

        Returns:
            bool tensor shaped like ``cum_logp``.
        """

    def observe(self, step: Step) -> None:
        """Feedback after each verification (history adaptation); no-op by default."""


@dataclass
class TreeSampling:
    """Drafting by sampling (issue 13): children drawn without replacement from the draft's processed distribution.

    One object per tree. :func:`_expand` fills ``draft_probs`` with the distribution each expanded node's
    children were drawn from, which :func:`~dtbench.decoders.sampling.verify_tree_sampled` needs.

    Attributes:
        settings: the sampling settings (temperature, top-k, top-p) applied to draft and target alike.
        generator: the sample's random generator.
        draft_probs: node index -> (vocab,) float64 processed draft distribution of its children.
    """

    settings: SamplingSettings
    generator: torch.Generator | None
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)


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
        self.dtype = modelinfo.dtype_of(model)
        self.device = modelinfo.device_of(model)
        self.prefix_len = 0
        self.fed: list[int] = []
        self._fed_t = torch.empty(0, dtype=torch.long, device=self.device)
        self._fed_ok: torch.Tensor | None = None  # validity of the fed slots (resident drafting only)
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
        self._fed_ok = None
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
        logits = kv.forward(
            self.model, tree.tokens[nodes_t].unsqueeze(0), self.cache, position_ids=pos, attention_mask=mask
        )
        self.forwards += 1
        self.fed.extend(nodes)
        self._fed_t = cols
        return logits, nodes_t

    def feed_slots(self, tree: TokenTree, nodes: torch.Tensor, valid: torch.Tensor, depth: int) -> torch.Tensor:
        """One draft forward over a resident level's static slots (:mod:`~dtbench.decoders.tree.resident`).

        Like :meth:`feed`, with padding: a slot whose ``valid`` is False feeds the root's token, attends to the
        prefix only, and no slot attends to it, so the valid slots' logits are those of the real frontier.
        ``fed`` is not kept on the host: the draft-cache position of each node comes back with the iteration's
        read and :meth:`commit` takes it.

        Args:
            nodes: (S,) int64 node indices (padding: 0); valid: (S,) bool; depth: the level's internal depth.

        Returns:
            (S, vocab) draft logits in the draft's dtype.
        """
        cols = torch.cat([self._fed_t, nodes])
        ok = valid if self._fed_ok is None else torch.cat([self._fed_ok, valid])
        mask = tree_attention_mask(tree.anc[nodes][:, cols] & ok, self.prefix_len, self.kind, self.dtype)
        pos = torch.full((1, nodes.numel()), self.prefix_len - 1 + depth, dtype=torch.long, device=self.device)
        logits = kv.forward(
            self.model, tree.tokens[nodes].unsqueeze(0), self.cache, position_ids=pos, attention_mask=mask
        )
        self.forwards += 1
        self._fed_t, self._fed_ok = cols, ok
        return logits

    def commit(self, root: int, path: list[int], committed: list[int], positions: list[int] | None = None) -> None:
        """Keep only the committed path in the draft cache (``kv.keep_positions``), backlog the rest.

        Args:
            root: this iteration's root token.
            path: committed node indices, root first (from :func:`select_path`).
            committed: committed tokens (path tokens without the root, then the bonus token).
            positions: resident drafting's cache offsets after the prefix of the path's fed nodes (root excluded,
                up to the first node never fed); None: found from :attr:`fed`.
        """
        path_tokens = committed[:-1]
        if not self.started:
            self.backlog += [root, *path_tokens]
            return
        if positions is not None:
            keep = [self.prefix_len + j for j in positions]
        else:
            pos = {u: self.prefix_len + j for j, u in enumerate(self.fed)}
            keep = []
            for u in path[1:]:
                if u not in pos:  # expanded nodes are ancestor-closed: the rest of the path was never fed
                    break
                keep.append(pos[u])
        kv.keep_positions(self.cache, self.prefix_len, keep)
        self.backlog = path_tokens[len(keep) :]
        self.started = False


def _expand(
    tree: TokenTree,
    parents_t: torch.Tensor,
    parent_depth: int,
    logits: torch.Tensor,
    policy: ExpansionPolicy,
    depth_cap: int,
    *,
    offset: int,
    prune: Prune,
    top1_only: bool = False,
    sampling: TreeSampling | None = None,
) -> list[int]:
    """Add the children of the expanded nodes ``parents_t`` (all at ``parent_depth``) from their draft logits.

    Per parent: the B(u) = policy.breadth(c(u)) most probable tokens in parent order then probability order,
    until the node budget is reached (Algorithm 1 lines 26-28). A child v with p(v) < tau is dropped
    (``prune="skip"``) or added as a leaf that is never expanded (``prune="leaf"``, lines 14-16). A child is
    expandable iff its internal depth is below ``depth_cap``, p(v) >= tau and ``policy.expandable`` holds at
    its depth in the policy's convention (internal depth - ``offset``).

    Args:
        parents_t: (E,) int64 node indices; parent_depth: their internal depth.
        logits: (E, vocab) draft logits q_D(. | u), any float dtype.
        depth_cap: hard cap on the children's internal depth (drafted tokens on a path).
        offset: :func:`root_offset` of the tree shape.
        prune: "leaf" or "skip".
        top1_only: add exactly the top-1 child whatever tau and B(u) say (u0 of a ``paper`` tree, line 10); when
            sampling, one drawn child.
        sampling: None for greedy drafting (the B(u) most probable tokens); otherwise the children are the first
            B(u) tokens drawn without replacement from the processed draft distribution, in draw order (u0 is one
            draw), and the distribution is recorded in ``sampling.draft_probs``. Breadth, pruning and depth rules
            still use the raw draft probabilities (confidence c(u) = max_v q_D(v | u), p(u) the product of raw
            q_D along the path), so the tree's shape rules are the greedy decoder's.

    Returns:
        The new nodes that are themselves expandable, in BFS order.
    """
    budget = tree.budget_left
    if budget <= 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = 1 if top1_only else min(policy.max_breadth, lp.shape[-1])
    if sampling is None:
        top_lp, top_tok = lp.topk(k, dim=-1)  # (E, k), sorted by probability
        confidence = top_lp[:, 0].exp()
    else:
        q = sampling.settings.probs(logits)
        top_tok, drawn = sample_without_replacement(q, k, sampling.generator)  # (E, k), in draw order
        top_lp = lp.gather(-1, top_tok)
        confidence = lp.max(dim=-1).values.exp()
        sampling.draft_probs.update(zip(parents_t.tolist(), q))
    cum = tree.cum_logp[parents_t].unsqueeze(1) + top_lp
    above = cum >= policy.log_tau
    if top1_only:
        keep = torch.ones_like(above)
    else:
        breadth = policy.breadth(confidence)
        keep = torch.arange(k, device=lp.device).unsqueeze(0) < breadth.unsqueeze(1)
        if prune == "skip":
            keep = keep & above
    if sampling is not None:
        keep = keep & drawn
    depth = parent_depth + 1
    codes = keep.to(torch.uint8)
    if depth < depth_cap:
        codes = codes | (policy.expandable(depth - offset, cum) & keep & above).to(torch.uint8) << 1
    flat = codes.flatten().tolist()
    sel = [i for i, c in enumerate(flat) if c][:budget]
    if not sel:
        return []
    sel_t = torch.tensor(sel, dtype=torch.long, device=lp.device)
    new = tree.add(
        parents_t[sel_t // k], top_tok.flatten()[sel_t], top_lp.flatten()[sel_t], cum.flatten()[sel_t], depth
    )
    return [new[j] for j, i in enumerate(sel) if flat[i] & 2]


def check_draft_options(strategy: str, prune: str, sampled: bool) -> None:
    """Validate the drafting options shared by :func:`draft_tree` and the driver (before any forward runs).

    Raises:
        ValueError: an unknown draft strategy or prune mode, or ``prune="skip"`` when ``sampled``.
    """
    if strategy not in ("per_level", "per_node"):
        raise ValueError(f"unknown draft strategy {strategy!r}")
    if prune not in ("leaf", "skip"):
        raise ValueError(f"unknown prune mode {prune!r}")
    if sampled and prune == "skip":
        raise ValueError(SKIP_WITH_SAMPLING)


def draft_tree(
    session: DraftSession,
    tree: TokenTree,
    root: int,
    policy: ExpansionPolicy,
    depth_cap: int,
    strategy: DraftStrategy,
    *,
    tree_root: TreeRoot = "paper",
    prune: Prune = "leaf",
    sampling: TreeSampling | None = None,
) -> None:
    """Grow ``tree`` (holding only the pending token) with the draft model (Algorithm 1, DRAFTTREE).

    The pending token (p = 1) is always expanded; its draft logits (q_D after the prefix x_{1:t}) come from
    ``session.start`` (which also feeds any backlog). With ``tree_root="paper"`` they give the single node u0
    (the top-1 token, the paper's root at depth 0, line 10), expanded by the rules like any node; with
    ``"pending"`` they give up to B(root) children. Children are created by :func:`_expand`.

    Args:
        session: the draft model and cache.
        tree: a root-only tree; filled in place, in BFS order.
        root: the pending token id (host int, equal to ``tree.tokens[0]``).
        policy: breadth, depth gating, pruning threshold and budget.
        depth_cap: no drafted node deeper than this internal depth, i.e. no path holds more drafted tokens
            (>= 1; the driver passes min(policy.depth_limit + root offset, tokens still needed - 1)).
        strategy: "per_node" = one cached draft step per expanded node, first-in first-out (the paper);
            "per_level" = one draft forward per depth over all expandable nodes of that level. Both build the
            same tree (same node order) given the same draft logits.
        tree_root: "paper" or "pending" (module docstring).
        prune: "leaf" (Algorithm 1) or "skip" (module docstring).
        sampling: None (greedy drafting) or the tree's :class:`TreeSampling` (children drawn; see :func:`_expand`).

    Raises:
        ValueError: for an unknown strategy, tree_root or prune mode, or ``prune="skip"`` with sampling.
    """
    check_draft_options(strategy, prune, sampling is not None)
    offset = root_offset(tree_root)
    logits = session.start(root)
    root_t = torch.zeros(1, dtype=torch.long, device=tree.device)
    frontier = _expand(
        tree,
        root_t,
        0,
        logits,
        policy,
        depth_cap,
        offset=offset,
        prune=prune,
        top1_only=tree_root == "paper",
        sampling=sampling,
    )
    if strategy == "per_level":
        depth = 1
        while frontier and tree.budget_left > 0:
            logits, nodes_t = session.feed(tree, frontier, depth)
            frontier = _expand(
                tree, nodes_t, depth, logits, policy, depth_cap, offset=offset, prune=prune, sampling=sampling
            )
            depth += 1
    else:
        queue = deque((u, 1) for u in frontier)
        while queue and tree.budget_left > 0:
            u, depth = queue.popleft()
            logits, nodes_t = session.feed(tree, [u], depth)
            queue.extend(
                (v, depth + 1)
                for v in _expand(
                    tree, nodes_t, depth, logits, policy, depth_cap, offset=offset, prune=prune, sampling=sampling
                )
            )


class TreeDrafter(ABC):
    """A drafter that grows each iteration's tree from the *target's* features instead of a draft model's cache.

    Learned drafting heads (Medusa, Cai et al. 2024; EAGLE-1/2/3, Li et al. 2024/2025) draft from the target's
    hidden states. :func:`~dtbench.decoders.tree.speculate_tree` takes one in place of an expansion policy and a
    draft model: it asks the target's prefill and verification forwards for :attr:`hidden_layers` (the same
    forwards the loop already runs, so no extra target forward) and hands the features of the committed
    positions to :meth:`feed_target`; verification, path selection and cache updates are the one tree loop's.

    Training-free drafters (Token Recycling, Lookahead) use the other two hooks instead: :meth:`feed_logits` hands
    them the verification forward's logits of every fed token, and :meth:`side_branch` lets tokens that are not
    verified (Lookahead's Jacobi window) ride in that same forward under their own attention pattern.

    Attributes:
        hidden_layers: indices into transformers' ``hidden_states`` tuple whose concatenation is the feature
            (``(num_hidden_layers,)``: the final-normed last hidden state; EAGLE-3: three inner layers); empty:
            no features (:meth:`feed_target` is then never called).
        max_breadth: most children of one node (sizes the tree's preallocation with :attr:`n_max`).
        n_max: most drafted nodes per tree.
        depth_limit: most drafted tokens on a root-to-leaf path (the tree is rooted at the pending token).
    """

    hidden_layers: tuple[int, ...] = ()
    max_breadth: int
    n_max: int
    depth_limit: int

    def feed_target(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Take the target's features of newly committed positions.

        Args:
            features: (m, F) target features (model dtype, on the target's device), row i the feature of the
                position after which ``next_tokens[i]`` was committed; after the prefill these are the prompt's
                positions (next tokens: the prompt shifted by one, then the first generated token), after each
                verification the committed path's nodes, root first (next tokens: the committed tokens).
            next_tokens: m token ids; the last is the next tree's root (the pending token).
        """

    def side_branch(self) -> SideBranch | None:
        """Unverified tokens to feed in the next verification forward, after the tree (None: none; the default).
        Called once per iteration, after :meth:`draft`."""
        return None

    def feed_logits(self, tree: TokenTree, logits: torch.Tensor, side_logits: torch.Tensor | None) -> None:
        """Take the logits of one verification forward (no-op by default); called before path selection's
        results reach :meth:`observe`.

        Args:
            tree: the verified tree (``tree.tokens[:tree.size]`` were fed, root first).
            logits: (tree.size, vocab) target logits (model dtype, target device), row u the logits after the path
                to node u.
            side_logits: (m, vocab) logits of this iteration's :meth:`side_branch` tokens, or None without one.
        """

    @abstractmethod
    def draft(self, tree: TokenTree, root: int, depth_cap: int) -> None:
        """Grow ``tree`` (holding only ``root``, the pending token) in place, in BFS order.

        Args:
            depth_cap: no node deeper than this (drafted tokens on a path, >= 1).
        """

    def observe(self, step: Step) -> None:
        """Feedback after each verification; no-op by default."""
