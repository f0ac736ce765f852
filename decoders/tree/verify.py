"""Tree verification (Algorithm 1 lines 4-6; paper 3.4-3.5): one target forward over the drafted tree under the tree
attention mask, the accepted path (greedy, sampled or typical), and the target cache kept to it.

Part of the tree toolkit (:mod:`dtbench.decoders.tree`); the one tree loop (:mod:`~dtbench.decoders.tree.loop`)
calls these for a single row (a plain cache), a :class:`~.draft.TreeDrafter`'s tree, or a ragged batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch

from dtbench.decoders import kv, modelinfo
from dtbench.decoders.sampling import SamplingSettings, verify_tree_sampled, verify_tree_typical
from dtbench.decoders.tree.draft import TreeDrafter, TreeSampling
from dtbench.decoders.tree.resident import Resident, ResidentDraft, apply_read, select_path_resident, size_read
from dtbench.decoders.tree.structure import (
    CacheStrategy,
    MaskKind,
    SideBranch,
    TokenTree,
    select_path,
    tree_attention_mask,
    tree_position_ids,
    with_side_branch,
)


def tree_predictions(target: torch.nn.Module, cache: kv.KVCache, tree: TokenTree, kind: MaskKind) -> torch.Tensor:
    """One target forward over [root, drafted nodes] with the tree mask (Algorithm 1 line 4), greedy.

    Args:
        target: the target causal LM; ``cache`` holds the committed prefix without the root.
        tree: the drafted tree.
        kind: the target's mask format (:func:`attention_mask_kind`).

    Returns:
        (size,) int64 greedy predictions: entry u is argmax p_T(. | prefix, path to u); entry 0 is the
        paper's y_hat_{t+1} (argmax of the prefix logits s_last). The cache grows by ``size`` positions.
    """
    return torch.argmax(tree_logits(target, cache, tree, kind), dim=-1).to(tree.device)


@overload
def tree_logits(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden_layers: None = None,
    side: SideBranch | None = None,
) -> torch.Tensor: ...


@overload
def tree_logits(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden_layers: tuple[int, ...] | None = None,
    side: SideBranch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def tree_logits(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden_layers: tuple[int, ...] | None = None,
    side: SideBranch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The target forward of :func:`tree_predictions`, returning its logits: (size, vocab) in the target's dtype,
    row u the target's logits of the token after the path to u. The cache grows by ``size`` positions.
    With ``hidden_layers`` (a :class:`TreeDrafter`'s), the pair (logits, features (size, F)) from the same forward
    (:func:`kv.forward`). With a ``side`` branch (m tokens, :class:`SideBranch`), its tokens are fed after the tree
    in the same forward (:func:`with_side_branch`): logits and features get m more rows and the cache m more
    positions, after the tree's."""
    n = tree.size
    prefix_len = kv.cache_len(cache)
    dev = modelinfo.device_of(target)
    tokens = tree.tokens[:n].to(dev)
    if side is None and n == 1:  # root only: a plain causal step
        return kv.forward(target, tokens.unsqueeze(0), cache, hidden_layers=hidden_layers)
    relation, depths = tree.ancestors().to(dev), tree.depths[:n].to(dev)
    if side is not None:
        relation = with_side_branch(relation, side)
        tokens = torch.cat([tokens, side.tokens.to(dev)])
        depths = torch.cat([depths, side.offsets.to(dev)])
    mask = tree_attention_mask(relation, prefix_len, kind, modelinfo.dtype_of(target))
    return kv.forward(
        target,
        tokens.unsqueeze(0),
        cache,
        position_ids=tree_position_ids(depths, prefix_len),
        attention_mask=mask,
        hidden_layers=hidden_layers,
    )


def row_probs(sampling: SamplingSettings, rows: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """``u -> sampling.probs(rows[u])``: the target's processed distribution after the path to node u."""
    return lambda u: sampling.probs(rows[u])


def update_target_cache(
    target: torch.nn.Module,
    cache: kv.KVCache,
    prefix_len: int,
    root: int,
    path: list[int],
    committed: list[int],
    cache_strategy: CacheStrategy,
) -> None:
    """Keep the accepted path in the target cache (Algorithm 1 line 6): ``compact`` keeps its KV entries by index;
    ``rebuild`` crops to the prefix and re-runs [root, path] (a second target forward)."""
    if cache_strategy == "compact":
        kv.keep_positions(cache, prefix_len, [prefix_len + u for u in path])
    else:
        kv.crop(cache, prefix_len)
        kv.forward(target, [root, *committed[:-1]], cache, last_only=True)


def verify_row(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    drafted: ResidentDraft | None,
    resident: Resident,
    drafter: TreeDrafter | None,
    hidden: tuple[int, ...] | None,
    sampling: SamplingSettings | None,
    drawn: TreeSampling | None,
    generator: torch.Generator | None,
) -> tuple[list[int], list[int], list[int] | None]:
    """Verify one row's tree with a plain target cache: a drafter's (:func:`verify_drafted`), sampled (recursive
    rejection sampling over the drawn children, :func:`~dtbench.decoders.sampling.verify_tree_sampled`) or greedy
    (:func:`verify_greedy`). Returns (path, committed, the path's draft-cache positions or None); the target cache
    holds the whole tree after it (:func:`update_target_cache` keeps the path)."""
    if drafter is not None:
        return (*verify_drafted(target, cache, tree, kind, hidden, drafter, sampling, generator), None)
    if sampling is None:
        return verify_greedy(target, cache, tree, kind, drafted, resident)
    assert drawn is not None  # sampling: a TreeSampling per tree
    logits, n = tree_logits(target, cache, tree, kind), tree.size
    path, committed = verify_tree_sampled(
        tree.tokens[:n].tolist(), tree.parents[:n].tolist(), row_probs(sampling, logits), drawn.draft_probs, generator
    )
    return path, committed, None


def verify_greedy(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    drafted: ResidentDraft | None,
    resident: Resident,
) -> tuple[list[int], list[int], list[int] | None]:
    """Greedy verification of one row's tree (Algorithm 1 lines 4-5): (path, committed, the path's draft-cache
    positions for a resident draft, else None). ``resident: full`` verifies the capacity-padded tree and reads
    once (:func:`select_path_resident`); ``draft`` reads the tree's size first, then verifies it exactly."""
    if drafted is None:  # host drafting, or nothing drafted
        n = tree.size
        pred = tree_predictions(target, cache, tree, kind)
        return (*select_path(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred), None)
    if resident == "full":
        tree.size = tree.capacity  # every slot is verified; padded rows see the prefix only
        pred = tree_predictions(target, cache, tree, kind)
        return apply_read(tree, select_path_resident(tree, drafted, pred).tolist())
    sized = size_read(drafted).tolist()
    tree.size, tree.max_depth = sized[0], sized[1]
    n = tree.size
    pred = tree_predictions(target, cache, tree, kind)
    path, committed = select_path(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred)
    positions = []
    for u in path[1:]:
        if sized[2 + u] < 0:
            break
        positions.append(sized[2 + u])
    return path, committed, positions


def verify_drafted(
    target: torch.nn.Module,
    cache: kv.KVCache,
    tree: TokenTree,
    kind: MaskKind,
    hidden: tuple[int, ...] | None,
    drafter: TreeDrafter,
    sampling: SamplingSettings | None,
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Verify a :class:`TreeDrafter`'s tree (with its side branch and features): (path, committed)."""
    n = tree.size
    side = drafter.side_branch()
    verified = tree_logits(target, cache, tree, kind, hidden, side)
    logits, tree_features = verified if isinstance(verified, tuple) else (verified, None)  # a pair with hidden layers
    drafter.feed_logits(tree, logits[:n], None if side is None else logits[n:])
    if sampling is None:
        pred = torch.argmax(logits[:n], dim=-1).to(tree.device)
        path, committed = select_path(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred)
    elif (typical := getattr(drafter, "typical", None)) is not None:  # medusa's opt-in lossy mode
        threshold, alpha = typical
        path, committed = verify_tree_typical(
            tree.tokens[:n].tolist(),
            tree.parents[:n].tolist(),
            logits[:n],
            sampling.temperature,
            threshold,
            alpha,
            generator,
        )
    else:  # a drafter's tree is a function of the context: deterministic children (q one-hot)
        path, committed = verify_tree_sampled(
            tree.tokens[:n].tolist(), tree.parents[:n].tolist(), row_probs(sampling, logits), {}, generator
        )
    if tree_features is not None:
        drafter.feed_target(tree_features[path], committed)
    return path, committed


def verify_batched(
    ragged: kv.RaggedBatch,
    trees: dict[int, TokenTree],
    active: list[int],
    pending: list[int],
    cache_strategy: CacheStrategy,
) -> dict[int, tuple[list[int], list[int]]]:
    """Verify every active row's tree in one batched target forward and keep each row's path: {row: (path,
    committed)} (``rebuild``: a second batched forward over each row's [root, path])."""
    logits = ragged.forward(
        [trees[r].tokens[: trees[r].size].tolist() for r in active],
        [trees[r].ancestors() if trees[r].size > 1 else None for r in active],
        [trees[r].depths[: trees[r].size] for r in active],
    )
    chosen = {}
    for i, r in enumerate(active):
        tree, n = trees[r], trees[r].size
        pred = torch.argmax(logits[i, :n], dim=-1).to(tree.device)
        chosen[r] = select_path(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), pred)
    if cache_strategy == "compact":
        ragged.keep([chosen[r][0] for r in active])
    else:
        ragged.keep([[] for _ in active])
        ragged.forward([[pending[r], *chosen[r][1][:-1]] for r in active])
        ragged.keep([list(range(len(chosen[r][1]))) for r in active])
    return chosen
