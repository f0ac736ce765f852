"""Device-resident tree drafting and path selection (issue 46 item 1): a tree iteration with one host read.

Part of the tree toolkit (:mod:`dtbench.decoders.tree`). The host-driven drafting of :func:`~.draft.draft_tree`
reads each drafted level back to the host (which children join the tree, which of them are expanded next): on a
GPU every such read waits for all queued kernels, so an iteration of a depth-8 tree serializes the host with the
device nine times. The ``resident`` option of the tree decoders (:class:`~dtbench.decoders.tree.TreeParams`)
keeps those decisions on the device instead:

- Every level the draft could feed (internal depths 1 .. depth_cap - 1) runs, each over a STATIC number of slots
  (:func:`level_slots`: the most expandable nodes that level can hold under the breadth bound and N_max), the
  slots beyond the level's real frontier padded and masked out of every attention row and column. The tree built
  is the host drafting's, node for node (same tokens, parents, order, budget cut; checked by
  ``tests/test_tree_resident.py``); what changes is the draft's compute: padded slots, and the levels the host
  would have stopped before (an empty frontier still costs a draft forward). Breadth B(u), the depth gate, pruning
  and the node budget are the policy's tensor rules (:class:`~.draft.ExpansionPolicy`), evaluated on the slots.
- ``resident: draft`` reads the tree's size once after drafting and verifies the exact tree (two reads per
  iteration); ``resident: full`` also verifies the tree padded to its capacity (padded rows attend only to the
  prefix, no node attends to them) and reads the accepted path, its bonus token, the tree's size and depth and the
  path's draft-cache positions in ONE read at the end of the iteration.

The same construction with static shapes is what production tree decoders run on GPUs (EAGLE-2's fixed top-k per
level, SafeAILab/EAGLE ``ea_model.py``/``utils.py``, and SGLang's EAGLE worker: fixed ``topk`` and
``num_steps`` so the draft phase is CUDA-graph capturable); here the dynamic rules of Algorithm 1 stay exact and
only their evaluation moves to the device. Greedy decoding with an expansion policy, per-level drafting and one
row only; sampling, tree drafters, ``per_node`` and batched rows keep the host path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dtbench.decoders.tree.draft import DraftSession, ExpansionPolicy
from dtbench.decoders.tree.structure import Prune, TokenTree, TreeRoot, root_offset

Resident = Literal["off", "draft", "full"]


def level_slots(first: int, max_breadth: int, depth_cap: int, n_max: int) -> list[int]:
    """Static slot counts of the levels a resident draft feeds: internal depths 1 .. depth_cap - 1.

    Args:
        first: most nodes the root's expansion creates (1 for a paper-rooted tree's u0, else the largest breadth).
        max_breadth: the policy's largest B(u); depth_cap: the tree's depth cap; n_max: the node budget N_max.

    Returns:
        [S_1, ..., S_{depth_cap-1}] with S_1 = min(first, N_max), S_{d+1} = min(S_d x max_breadth, N_max): a level
        never holds more expandable nodes (empty when depth_cap <= 1).
    """
    slots, s = [], min(first, n_max)
    for _ in range(1, depth_cap):
        slots.append(s)
        s = min(s * max_breadth, n_max)
    return slots


@dataclass
class ResidentDraft:
    """What a resident draft leaves on the device for the iteration's one read.

    Attributes:
        size: () int64, nodes in the tree, root included (the host's ``tree.size`` is stale until the read).
        max_depth: () int64, the deepest node's internal depth.
        draft_pos: (capacity + 1,) int64, each node's offset after the draft cache's prefix (-1: never fed).
    """

    size: torch.Tensor
    max_depth: torch.Tensor
    draft_pos: torch.Tensor


def _expand_slots(
    tree: TokenTree,
    size: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    parent_depth: int,
    logits: torch.Tensor,
    policy: ExpansionPolicy,
    depth_cap: int,
    next_slots: int,
    *,
    offset: int,
    prune: Prune,
    top1_only: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.draft._expand` with no host read: the children of the valid slots join the tree by index.

    Args:
        tree: built with one spare slot (``TokenTree(..., spare=1)``): index ``tree.capacity`` takes the writes of
            children that do not join, so every write has a static shape.
        size: () int64 tree size, updated in place.
        parents, valid: (S,) int64 node indices and bool validity of this level's slots (padding: index 0, False).
        logits: (S, vocab) the slots' draft logits.
        next_slots: the next level's static slot count.

    Returns:
        (next parents (next_slots,) int64, next valid (next_slots,) bool): the expandable new nodes in BFS order,
        the rest padding.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = 1 if top1_only else min(policy.max_breadth, lp.shape[-1])
    top_lp, top_tok = lp.topk(k, dim=-1)  # (S, k), sorted by probability, as the host rule
    cum = tree.cum_logp[parents].unsqueeze(1) + top_lp
    above = cum >= policy.log_tau
    if top1_only:
        keep = torch.ones_like(above)
    else:
        keep = torch.arange(k, device=lp.device).unsqueeze(0) < policy.breadth(top_lp[:, 0].exp()).unsqueeze(1)
        if prune == "skip":
            keep = keep & above
    keep = (keep & valid.unsqueeze(1)).flatten()
    depth = parent_depth + 1
    expand = torch.zeros_like(keep)
    if depth < depth_cap:
        expand = (policy.expandable(depth - offset, cum) & above).flatten()
    rank = torch.cumsum(keep, 0) - 1  # the host's order: parent by parent, then probability
    joins = keep & (rank < tree.capacity - size)  # the budget cut (N_max and capacity)
    spare = tree.capacity
    index = torch.where(joins, size + rank, spare)
    parent_of = parents.repeat_interleave(k)
    tree.parents.index_copy_(0, index, parent_of)
    tree.tokens.index_copy_(0, index, top_tok.flatten())
    tree.logp.index_copy_(0, index, top_lp.flatten())
    tree.cum_logp.index_copy_(0, index, cum.flatten())
    tree.depths.index_fill_(0, index, depth)
    tree.anc.index_copy_(0, index, tree.anc[parent_of])
    tree.anc[index, index] = True
    tree.anc[spare].zero_()  # the spare row and column hold no relation
    tree.anc[:, spare] = False
    size += joins.sum()
    grow = joins & expand
    slot = torch.where(grow, torch.cumsum(grow, 0) - 1, next_slots)
    nxt = torch.zeros(next_slots + 1, dtype=torch.long, device=lp.device)
    nxt.index_copy_(0, slot, index)
    ok = torch.zeros(next_slots + 1, dtype=torch.bool, device=lp.device)
    ok.index_fill_(0, slot, True)
    return nxt[:next_slots], ok[:next_slots]


def draft_tree_resident(
    session: DraftSession,
    tree: TokenTree,
    root: int,
    policy: ExpansionPolicy,
    depth_cap: int,
    *,
    tree_root: TreeRoot = "paper",
    prune: Prune = "leaf",
) -> ResidentDraft:
    """Grow ``tree`` as :func:`~.draft.draft_tree` does with ``per_level`` greedy drafting, without a host read.

    Args:
        session: the draft model and cache (:meth:`DraftSession.feed_slots` feeds the padded levels).
        tree: a root-only tree with one spare slot (``spare=1``); filled in place, in BFS order.
        root: the pending token id; policy, depth_cap, tree_root, prune: as :func:`~.draft.draft_tree`.

    Returns:
        The device-side size, depth and draft-cache positions (:class:`ResidentDraft`); ``tree.size`` and
        ``tree.max_depth`` are set by :func:`apply_read` once the iteration's read is done.
    """
    offset = root_offset(tree_root)
    dev = tree.device
    size = torch.ones((), dtype=torch.long, device=dev)
    slots = level_slots(1 if tree_root == "paper" else policy.max_breadth, policy.max_breadth, depth_cap, tree.n_max)
    logits = session.start(root)
    parents = torch.zeros(1, dtype=torch.long, device=dev)
    valid = torch.ones(1, dtype=torch.bool, device=dev)
    fed, fed_ok = [], []
    for depth in range(len(slots) + 1):
        next_slots = slots[depth] if depth < len(slots) else 0
        parents, valid = _expand_slots(
            tree,
            size,
            parents,
            valid,
            depth,
            logits,
            policy,
            depth_cap,
            next_slots,
            offset=offset,
            prune=prune,
            top1_only=depth == 0 and tree_root == "paper",
        )
        if next_slots:
            logits = session.feed_slots(tree, parents, valid, depth + 1)
            fed.append(parents)
            fed_ok.append(valid)
    pos = torch.full((tree.capacity + 1,), -1, dtype=torch.long, device=dev)
    if fed:
        nodes, ok = torch.cat(fed), torch.cat(fed_ok)
        order = torch.arange(nodes.numel(), device=dev)
        pos.index_copy_(0, torch.where(ok, nodes, tree.capacity), order)
        pos[tree.capacity] = -1
    alive = torch.arange(tree.capacity, device=dev) < size
    return ResidentDraft(size, torch.where(alive, tree.depths[: tree.capacity], 0).max(), pos)


def size_read(draft: ResidentDraft) -> torch.Tensor:
    """``resident: draft``'s mid-iteration read, packed: [size, max_depth, draft positions of every slot]."""
    return torch.cat([draft.size.view(1), draft.max_depth.view(1), draft.draft_pos[:-1]])


def select_path_resident(tree: TokenTree, draft: ResidentDraft, pred: torch.Tensor) -> torch.Tensor:
    """:func:`~.structure.select_path` over a capacity-padded tree, packed for the iteration's one read.

    Args:
        tree: the drafted tree (``tree.capacity`` slots verified, the valid ones the first ``draft.size``).
        pred: (capacity,) int64 target argmax after the path to every slot.

    Returns:
        (2 x capacity + 3,) int64: per slot its token if on the accepted path else -1; the bonus token; the size;
        the depth; per slot its draft-cache position if on the path else -1 (:func:`apply_read` unpacks it).
    """
    c = tree.capacity
    alive = torch.arange(c, device=pred.device) < draft.size
    tokens, anc = tree.tokens[:c], tree.anc[:c, :c]
    matched = (tokens == pred[tree.parents[:c]]) & alive
    matched[0] = True
    consistent = ~(anc & ~matched.unsqueeze(0)).any(dim=1) & alive
    end = torch.argmax(torch.where(consistent, tree.depths[:c], -1))  # first maximum, as select_path
    on = anc[end]
    return torch.cat(
        [
            torch.where(on, tokens, -1),
            pred[end].view(1),
            draft.size.view(1),
            draft.max_depth.view(1),
            torch.where(on, draft.draft_pos[:c], -1),
        ]
    )


def apply_read(tree: TokenTree, read: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Unpack :func:`select_path_resident`'s read: sets ``tree.size``/``tree.max_depth``; returns (path, committed,
    the path's draft-cache positions after the prefix, in path order, root excluded, up to the first unfed node)."""
    c = tree.capacity
    path = [i for i in range(c) if read[i] >= 0]
    tree.size, tree.max_depth = int(read[c + 1]), int(read[c + 2])
    positions = []
    for u in path[1:]:
        if read[c + 3 + u] < 0:
            break
        positions.append(int(read[c + 3 + u]))
    return path, [int(read[i]) for i in path[1:]] + [int(read[c])], positions


def check_resident(resident: str, drafter: bool, sampled: bool, batched: bool, draft_strategy: str) -> None:
    """Validate the ``resident`` option against the loop's other settings (before any forward runs).

    Raises:
        ValueError: an unknown mode, or a resident mode with a tree drafter, sampling, batched rows or ``per_node``.
    """
    if resident not in ("off", "draft", "full"):
        raise ValueError(f"unknown resident mode {resident!r} (off, draft or full)")
    if resident != "off" and (drafter or sampled or batched or draft_strategy != "per_level"):
        raise ValueError(
            f"resident: {resident} drafts greedily with an expansion policy, per_level, one row at a time "
            "(no tree drafter, sampling, batching or per_node); use resident: off"
        )
