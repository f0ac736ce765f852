"""EAGLE-2 / EAGLE-3 decoding: a learned head drafts a dynamic tree from the target's features (Li et al. 2024/2025).

Reference read: SafeAILab/EAGLE ``eagle/model/cnets1.py`` (EAGLE-1/2 head) and ``eagle/model/cnets.py``
(EAGLE-3 head), both ``Model.topK_genrate``; ``eagle/model/ea_model.py`` and ``utils.py`` (the loop). The head
(module, loading, the version read from config.json) is :mod:`dtbench.decoders.heads`; this module is its
drafting policy, a :class:`~dtbench.decoders.tree.TreeDrafter` on the one tree loop
(:func:`~dtbench.decoders.tree.speculate_tree`), which verifies greedily, selects the path and updates the
target cache.

EAGLE-2's dynamic tree (``topK_genrate``), as dtbench runs it:

1. The head's own KV cache holds the committed positions, each computed from the *target's* feature (never the
   head's guess): the pairs (target feature of position t, token t + 1) arrive from the prefill and from every
   verification forward (``feed_target``: the committed path's features, which the loop's verify forward returns
   together with its logits; no extra target forward) and are fed in one causal head forward at the start of the
   next draft. Its last output gives the root's ``top_k`` children (depth 1).
2. ``depth`` times: the ``top_k`` best candidates of the newest level by cumulative log-probability (their
   parents' score + their own log-probability) are fed in one head forward under the tree mask, each with its
   parent's head output as feature; each gives ``top_k`` children, candidates of the next level.
3. The tree verified is the ``total_token - 1`` best candidates by cumulative log-probability over all levels
   (a node's score never exceeds its parent's, so the set is a tree; ties keep the parent, the earlier
   candidate), rooted at the pending token. The head's cache is cropped back to the committed positions (the
   drafted nodes' KV is recomputed from target features once committed, as the reference does).

So a tree holds at most ``total_token`` tokens (root included) and ``depth + 1`` drafted levels.
EAGLE-3 differs only in the head (three target layers, its own norm and draft vocabulary mapped by ``d2t``).

Sampling (issue 34 item 2): the tree is a function of the context (top-k by the head's scores, never drawn), so it
is verified by recursive rejection over each node's children with q one-hot on each child in turn (accept x with
probability p(x); on rejection p(x) = 0, renormalised; the bonus or residual token drawn from what is left), as
SafeAILab/EAGLE's ``evaluate_posterior`` does with a logits processor (``eagle/model/utils.py`` at cb7e084:
``qx = 1.0``, ``gtp[xi] = 0; gtp = gtp / gtp.sum()``): the committed tokens follow the target's processed
distribution exactly (:func:`~dtbench.decoders.sampling.verify_tree_sampled`; the chi-square test of
tests/test_sampling.py). The head drafts the same tree as under greedy decoding (its scores ignore the sampling
settings, as the reference's ``topK_genrate`` does). Under sampling the budget record (``budget_stats``) still
counts greedy-acceptance nodes; the cost model's best ``total_token`` is a greedy-decoding prediction.

Checked against SafeAILab/EAGLE at cb7e084. Where dtbench differs (the committed tokens are the greedy target's
either way; these change which nodes are drafted, or only edge cases): the head's log-probabilities and cumulative
scores are float32 (the reference ranks them in the model's fp16/bf16, so near-equal candidates can order
differently); ties keep the earlier candidate, so a chosen node's parent is always chosen (the reference's ``topk``
leaves tie order open); the tree's depth is capped by the tokens left to generate (the reference drafts past
``max_new_tokens`` and stops afterwards); there is no ``total_token=-1`` (the reference's timed auto choice).
"""

from __future__ import annotations

from typing import Annotated, Any, cast

import torch
from pydantic import Field

from dtbench.decoders import kv
from dtbench.decoders.base import DecoderParams, Step
from dtbench.decoders.eagle_head import EagleHead, check_eagle, load_eagle
from dtbench.decoders.heads import HeadDecoder
from dtbench.decoders.tree import TreeDrafter, speculate_tree
from dtbench.decoders.tree.structure import CacheStrategy, TokenTree


class EagleDrafter(TreeDrafter):
    """EAGLE-2's dynamic draft tree (``topK_genrate``) from an EAGLE-1/2 or EAGLE-3 head with its own KV cache.

    Attributes:
        head: the loaded :class:`~dtbench.decoders.eagle_head.EagleHead` (its forward is the decoder's draft forward).
        top_k, depth, total_token: EAGLE-2's parameters (see :class:`EagleParams`).
        cache: the head's ``DynamicCache``, holding the committed pairs between drafts.
        needing, drafting_iterations: the node-budget record of :meth:`budget_stats` (accepted tokens by the
            number of best-scored drafted nodes their tree needed; trees drafted).
    """

    def __init__(self, head: EagleHead, top_k: int, depth: int, total_token: int):
        self.head = head
        self.top_k, self.depth, self.total_token = top_k, depth, total_token
        self.hidden_layers = head.hidden_layers
        self.max_breadth = top_k
        self.n_max = total_token - 1
        self.depth_limit = depth + 1
        self.cache = kv.new_cache()
        self._features: list[torch.Tensor] = []
        self._tokens: list[int] = []
        # Budget accounting for the cost model: per accepted token, how many of the tree's best-scored drafted
        # nodes a tree must hold to contain it (and its path); see :meth:`budget_stats`.
        self.needing: dict[int, int] = {}
        self.drafting_iterations = 0
        self._drafted: tuple[TokenTree, torch.Tensor] | None = None

    def feed_target(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        if self._drafted is not None:
            self._count_accepted(next_tokens[:-1])
        self._features.append(features)
        self._tokens.extend(next_tokens)

    def _count_accepted(self, accepted: list[int]) -> None:
        """Record, for the accepted path of the last tree, the node budget each accepted token needed.

        The tree holds the best candidates by score, a node's score never above its parent's, so a budget of m
        drafted nodes (total_token = m + 1) keeps exactly the accepted path's nodes ranked below m, a prefix of
        the path; greedy verification of that smaller tree accepts exactly that prefix (the target's predictions
        along the path do not change). One host sync per verification.
        """
        assert self._drafted is not None, "called after a draft only (feed_target)"
        tree, rank = self._drafted
        self._drafted = None
        self.drafting_iterations += 1
        n = tree.size
        parents, tokens, ranks = tree.parents[:n].tolist(), tree.tokens[:n].tolist(), rank.tolist()
        nodes, needed = [0], 0
        for token in accepted:  # siblings hold distinct tokens; a list keeps a test's planted duplicates harmless
            nodes = [u for u in range(1, n) if parents[u] in nodes and tokens[u] == token]
            if not nodes:
                break
            needed = max(needed, min(ranks[u] for u in nodes) + 1)
            self.needing[needed] = self.needing.get(needed, 0) + 1

    def budget_stats(self) -> dict[str, int]:
        """``drafting_iterations``, ``drafted_nodes`` (total_token - 1) and ``accepted_tokens_needing_{m}_nodes``:
        accepted tokens whose path lies within the m best-scored drafted nodes but not the m - 1 best
        (m = 1 .. total_token - 1). The cost model derives the tokens per iteration every smaller ``total_token``
        would have committed on the same run (exact for greedy verification)."""
        return {
            "drafting_iterations": self.drafting_iterations,
            "drafted_nodes": self.n_max,
            **{f"accepted_tokens_needing_{m}_nodes": c for m, c in sorted(self.needing.items())},
        }

    def _forward(
        self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # keyword arguments: the runner's forward hooks read input_ids and past_key_values from them
        return self.head(
            input_ids=ids[None],
            features=features,
            position_ids=positions[None],
            ancestors=ancestors,
            past_key_values=self.cache,
        )

    def _feed_committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the pending (target feature, token) pairs causally; return the last pair's (hidden (1, 1, h),
        log-probabilities (V,))."""
        dev = self.head.fc.weight.device
        features = torch.cat(self._features)[None].to(dev)
        ids = torch.tensor(self._tokens, dtype=torch.long, device=dev)
        start, n = kv.cache_len(self.cache), len(self._tokens)
        self._features, self._tokens = [], []
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        hidden, logp = self._forward(ids, features, torch.arange(start, start + n, device=dev), causal)
        return hidden[:, -1:], logp[-1]

    def draft(self, tree: TokenTree, root: int, depth_cap: int) -> None:
        """Grow ``tree`` (the pending token only) with EAGLE-2's dynamic tree, no deeper than ``depth_cap``."""
        hidden, logp = self._feed_committed()
        committed = kv.cache_len(self.cache)
        dev = logp.device
        k = min(self.top_k, logp.shape[-1])
        lp, tok = logp.topk(k)
        # Candidates, level by level: score (cumulative log-prob), own log-prob, target token, parent candidate
        # (-1: the root) and level; the first k are the root's children.
        scores, own, tokens = [lp], [lp], [self.head.to_target(tok)]
        parents = [torch.full((k,), -1, dtype=torch.long, device=dev)]
        fed_ids, fed_feat, fed_scores = tokens[0], hidden.expand(1, k, -1), lp
        fed_cand = torch.arange(k, device=dev)  # candidate index of each fed node
        anc = torch.eye(k, dtype=torch.bool, device=dev)  # fed nodes' ancestor rows over the fed tree positions
        n_cand = k
        for level in range(1, min(self.depth, depth_cap - 1) + 1):
            positions = torch.full((k,), committed + level - 1, dtype=torch.long, device=dev)
            out, lp_all = self._forward(fed_ids, fed_feat, positions, anc[-k:])
            lp, tok = lp_all.topk(k, dim=-1)  # (k, k): children of each fed node
            cum = fed_scores[:, None] + lp
            scores.append(cum.flatten())
            own.append(lp.flatten())
            tokens.append(self.head.to_target(tok).flatten())
            parents.append(fed_cand.repeat_interleave(k))
            best = cum.flatten().topk(k).indices  # the next level's fed nodes (topk_cs_index)
            rows = anc[-k:][best // k]
            anc = torch.cat(
                (
                    torch.cat((anc, torch.zeros(anc.shape[0], k, dtype=torch.bool, device=dev)), 1),
                    torch.cat((rows, torch.eye(k, dtype=torch.bool, device=dev)), 1),
                )
            )
            fed_ids, fed_feat, fed_scores = tokens[-1][best], out[:, best // k], cum.flatten()[best]
            fed_cand = n_cand + best
            n_cand += k * k
        kv.crop(self.cache, committed)
        rank = self._add_best(tree, torch.cat(scores), torch.cat(own), torch.cat(tokens), torch.cat(parents), k)
        self._drafted = (tree, rank) if rank is not None else None

    @staticmethod
    def _add_best(
        tree: TokenTree, scores: torch.Tensor, own: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, k: int
    ) -> torch.Tensor | None:
        """Add the best candidates by score to ``tree`` in BFS order (one host sync for the level sizes); return
        each tree node's rank by score among the drafted nodes ((size,) int64, the root -1), None if none fit."""
        n = min(tree.budget_left, scores.numel())
        if n <= 0:
            return None
        order = torch.sort(scores, descending=True, stable=True).indices[:n]
        rank_of = torch.empty(scores.numel(), dtype=torch.long, device=scores.device)
        rank_of[order] = torch.arange(n, device=scores.device)
        sel = torch.sort(order).values
        levels = torch.where(sel < k, 1, 2 + (sel - k) // (k * k))
        node_of = torch.zeros(scores.numel() + 1, dtype=torch.long, device=scores.device)  # last slot: root
        start = 0
        for level, count in enumerate(torch.bincount(levels).tolist()):
            if count == 0:
                continue
            idx = sel[start : start + count]
            start += count
            par = parents[idx]
            new = tree.add(
                node_of[par].to(tree.device),
                tokens[idx].to(tree.device),
                own[idx].to(tree.device),
                scores[idx].to(tree.device),
                level,
            )
            node_of[idx] = torch.arange(new.start, new.stop, device=scores.device)
        rank = torch.full((tree.size,), -1, dtype=torch.long, device=scores.device)
        rank[node_of[sel]] = rank_of[sel]
        return rank


class EagleParams(DecoderParams):
    """Hyperparameters of ``eagle``.

    Attributes:
        head: a local folder or hub id in SafeAILab/EAGLE's published format: ``config.json`` and
            ``pytorch_model.bin`` or ``model.safetensors`` (e.g. yuhuili/EAGLE-Vicuna-7B-v1.3 for EAGLE-1/2,
            yuhuili/EAGLE3-LLaMA3.1-Instruct-8B for EAGLE-3; the version is read from config.json).
        top_k: children per expanded node, and nodes expanded per level (``top_k`` of ``topK_genrate``).
        depth: head forwards per tree after the root's (the tree holds up to depth + 1 drafted levels).
        total_token: tokens per verification, root included (``total_token``; the tree has total_token - 1
            drafted nodes).
        cache_strategy: the tree loop's target cache update (see :class:`~dtbench.decoders.tree.TreeParams`).

    Defaults: ``total_token=60``, ``depth=5``, ``top_k=10``, the reference's evaluation scripts'
    (``eagle/evaluation/gen_ea_answer_vicuna.py`` and ``gen_ea_answer_llama3chat.py``, which produce the papers'
    numbers); ``EaModel.from_pretrained`` itself defaults ``depth`` to 7 since the EAGLE-3 release.
    """

    head: str = Field(..., min_length=1, description="EAGLE head: local folder or hub id (config.json + weights)")
    top_k: Annotated[int, Field(ge=1, le=64)] = Field(10, description="children per node and nodes fed per level")
    depth: Annotated[int, Field(ge=0, le=64)] = Field(5, description="head forwards per tree after the root's")
    total_token: Annotated[int, Field(ge=2, le=1024)] = Field(
        60, description="tokens per verification, root included (total_token - 1 drafted nodes)"
    )
    cache_strategy: CacheStrategy = Field("compact", description="'compact' (1 target forward) or 'rebuild'")


class Eagle(HeadDecoder):
    """EAGLE-2 decoding with an EAGLE-1/2 or EAGLE-3 head in the one tree loop; lossless, greedy or sampled.

    Capabilities (:class:`~dtbench.decoders.heads.HeadDecoder`): family ``tree``; verify sizes (0 chain tokens,
    ``total_token`` masked); sampling: exact (module docstring). The head's forward is the decoder's draft forward.
    """

    Params = EagleParams
    version = "1"
    supports_sampling = True

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """An EAGLE-1/2 head in the published format (random weights) sized for the context's target; a small tree."""
        return [{"head": ctx.eagle_head(), "top_k": 3, "depth": 3, "total_token": 10}]

    load_head = staticmethod(load_eagle)
    check_head = staticmethod(check_eagle)

    def state_stats(self) -> dict[str, int] | None:
        """The last ``generate()``'s budget accounting (:meth:`EagleDrafter.budget_stats`), stored with the sample:
        the cost model's predicted best ``total_token`` comes from it."""
        drafter = getattr(self, "_drafter", None)
        return drafter.budget_stats() if drafter is not None else None

    @classmethod
    def verify_sizes(cls, params: EagleParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification: (0, total_token), root included."""
        return 0, params.total_token

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int):
        """Run :func:`speculate_tree` with an :class:`EagleDrafter` (see there for the Steps)."""
        p = self.params
        head = cast(EagleHead, self.draft)  # HeadDecoder.__init__: load_eagle's module
        drafter = self._drafter = EagleDrafter(head, p.top_k, p.depth, p.total_token)
        yield from speculate_tree(
            self.target,
            None,
            input_ids,
            max_new_tokens,
            drafter,
            p.cache_strategy,
            tree_root="pending",
            sampling=self.sampling,
            generator=self.generator,
            eos_token_id=self.eos_token_id,
        )


__all__ = ["Eagle", "EagleDrafter", "EagleParams", "Step"]
