"""Token Recycling: drafts from an adjacency matrix of the target's own past top-k candidates (Luo et al. 2024).

Paper: Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large Language Models with Token
Recycling" (arXiv 2408.08696, ACL 2025). Reference read: Luowaterbi/TokenRecycling (``model/recycling/
tree_template_.py``: the static tree template "2.2.2", 80 nodes on 6 levels, each node a path of ranks into its
parent's candidate list; README: ``--output-id-topk 8``).

The method. A vocabulary x k matrix ``M`` holds, for every token t, the k candidate tokens the target ranked highest
the last time t was fed to it (the "trash" of earlier forwards: top-k tokens beyond the one kept). Each iteration
the static template is expanded breadth-first from the pending token: the node at rank path (c_1, ..., c_d) is
``M[parent token, c_d]``. The tree is verified by the one tree loop (:func:`~dtbench.decoders.tree.speculate_tree`),
and the top-k of every verified position's logits (the root's and every drafted node's, accepted or not) replace
the rows of the tokens fed there. No draft model, no training, no datastore.

Differences from the reference, on purpose: rows never written hold no candidates (-1), and a template node whose
parent's row is empty is not drafted (the reference starts from an arbitrary matrix); the matrix starts empty at
every ``generate()`` call ("cold start"), because the runner builds a decoder per prompt and a sample must not
depend on which prompts ran before it (a matrix kept across queries, a "hot start", is what smpanaro/
token-recycling, an unofficial reimplementation, reports beside its cold-start numbers). Where one token was fed
at several nodes of a tree, its row takes the top-k of its last node in BFS order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, cast

import torch
from pydantic import Field, model_validator

from dtbench.decoders import modelinfo
from dtbench.decoders.base import Decoder, DecoderParams
from dtbench.decoders.medusa import static_tree
from dtbench.decoders.tree import TreeDrafter, speculate_tree
from dtbench.decoders.tree.structure import CacheStrategy, TokenTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# model/recycling/tree_template_.py, version "2.2.2" (the reference's default), verbatim: 80 rank paths.
TEMPLATE_2_2_2 = [
    [0],
    [1],
    [2],
    [3],
    [4],
    [5],
    [6],
    [7],
    [0, 0],
    [0, 1],
    [0, 2],
    [0, 3],
    [0, 4],
    [0, 5],
    [0, 6],
    [0, 7],
    [1, 0],
    [1, 1],
    [1, 2],
    [1, 3],
    [2, 0],
    [2, 1],
    [2, 2],
    [3, 0],
    [3, 1],
    [4, 0],
    [5, 0],
    [6, 0],
    [7, 0],
    [0, 0, 0],
    [0, 0, 1],
    [0, 0, 2],
    [0, 0, 3],
    [0, 0, 4],
    [0, 0, 5],
    [0, 0, 6],
    [0, 0, 7],
    [0, 1, 0],
    [0, 1, 1],
    [0, 1, 2],
    [0, 2, 0],
    [0, 2, 1],
    [0, 3, 0],
    [0, 4, 0],
    [0, 5, 0],
    [0, 6, 0],
    [0, 7, 0],
    [1, 0, 0],
    [1, 0, 1],
    [1, 1, 0],
    [2, 0, 0],
    [3, 0, 0],
    [4, 0, 0],
    [5, 0, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 1],
    [0, 0, 0, 2],
    [0, 0, 0, 3],
    [0, 0, 0, 4],
    [0, 0, 1, 0],
    [0, 0, 1, 1],
    [0, 0, 2, 0],
    [0, 0, 3, 0],
    [0, 0, 4, 0],
    [0, 1, 0, 0],
    [0, 2, 0, 0],
    [1, 0, 0, 0],
    [2, 0, 0, 0],
    [3, 0, 0, 0],
    [0, 0, 0, 0, 0],
    [0, 0, 0, 0, 1],
    [0, 0, 0, 0, 2],
    [0, 0, 0, 1, 0],
    [0, 0, 0, 2, 0],
    [0, 0, 1, 0, 0],
    [0, 1, 0, 0, 0],
    [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 1],
    [0, 0, 0, 1, 0, 0],
]
TEMPLATES = {"2.2.2": TEMPLATE_2_2_2}
Rank = Annotated[int, Field(ge=0, le=255)]


class TokenRecyclingDrafter(TreeDrafter):
    """Expands the static template over the adjacency matrix and refreshes the matrix from every verify forward.

    Attributes:
        adjacency: (vocab, k) int32 on the target's device, row t the top-k candidates after token t (best first),
            -1 where t was never fed.
        paths, parents: the template in BFS order (:func:`~dtbench.decoders.medusa.static_tree`).
    """

    def __init__(self, vocab_size: int, k: int, template: list[list[int]], device: torch.device):
        """Args: vocab_size: rows of the matrix (the target's logits width); k: candidates per row (> every
        template rank); template: rank paths; device: the target's device."""
        self.k = k
        self.paths, self.parents = static_tree(template)
        self.adjacency = torch.full((vocab_size, k), -1, dtype=torch.int32, device=device)
        self.max_breadth = max(self.parents.count(p) for p in set(self.parents))
        self.n_max = len(self.paths)
        self.depth_limit = max(len(c) for c in self.paths)
        self.levels = [[i for i, c in enumerate(self.paths) if len(c) == d] for d in range(1, self.depth_limit + 1)]

    @property
    def adjacency_bytes(self) -> int:
        """Bytes of the adjacency matrix (vocab x k x 4)."""
        return self.adjacency.numel() * self.adjacency.element_size()

    def draft(self, tree: TokenTree, root: int, depth_cap: int) -> None:
        """Breadth-first expansion of the template from ``root``, one matrix gather and one host sync per level;
        a node whose parent's row is empty, or beyond ``depth_cap`` or the budget, is not drafted."""
        node_of = {-1: 0}  # template index -> tree node index (-1: the root)
        for d, level in enumerate(self.levels[:depth_cap], start=1):
            level = [i for i in level if self.parents[i] in node_of]
            if not level:
                break
            parents = torch.tensor([node_of[self.parents[i]] for i in level], device=tree.device)
            ranks = torch.tensor([self.paths[i][-1] for i in level], device=self.adjacency.device)
            cand = self.adjacency[tree.tokens[parents].to(self.adjacency.device), ranks].to(tree.device)
            keep = (cand >= 0).nonzero().flatten()[: tree.budget_left]
            kept = keep.tolist()
            if not kept:
                break
            zeros = torch.zeros(len(kept), dtype=torch.float32, device=tree.device)
            new = tree.add(parents[keep], cand[keep].long(), zeros, zeros, d)
            node_of.update(zip((level[j] for j in kept), new))

    def feed_logits(self, tree: TokenTree, logits: torch.Tensor, side_logits: torch.Tensor | None) -> None:
        """Row ``tokens[u]`` <- top-k of ``logits[u]`` for every fed node u (the last node of a repeated token)."""
        dev = self.adjacency.device
        tokens = tree.tokens[: tree.size].to(dev)
        top = torch.topk(logits.to(dev), self.k, dim=-1).indices.to(torch.int32)
        uniq, inverse = torch.unique(tokens, return_inverse=True)
        last = torch.full((uniq.numel(),), -1, dtype=torch.long, device=dev).scatter_reduce(
            0, inverse, torch.arange(tokens.numel(), device=dev), reduce="amax"
        )
        self.adjacency[tokens[last]] = top[last]


class TokenRecyclingParams(DecoderParams):
    """Hyperparameters of ``token_recycling`` (defaults: the reference's).

    Attributes:
        k: candidates kept per token, the matrix width (reference ``--output-id-topk``, default 8).
        template: the static tree: ``"2.2.2"`` (the reference's default, 80 nodes, depth 6) or a list of rank
            paths (every rank < k, every path's prefix a path too).
        cache_strategy: the tree loop's target cache update (see :class:`~dtbench.decoders.tree.TreeParams`).
    """

    k: int = Field(8, ge=1, le=256, description="candidate tokens kept per vocabulary entry (adjacency width)")
    template: (
        Literal["2.2.2"]
        | Annotated[list[Annotated[list[Rank], Field(min_length=1)]], Field(min_length=1, max_length=1024)]
    ) = Field("2.2.2", description="static tree: '2.2.2' (the reference's, 80 nodes) or a list of rank paths")
    cache_strategy: CacheStrategy = Field("compact", description="'compact' (1 target forward) or 'rebuild'")

    @model_validator(mode="after")
    def _ranks_below_k(self):
        paths = TEMPLATES[self.template] if isinstance(self.template, str) else self.template
        if max(r for c in paths for r in c) >= self.k:
            raise ValueError(f"template ranks must be below k={self.k} (a row holds k candidates)")
        static_tree(paths)  # distinct paths, each with its parent
        return self


class TokenRecycling(Decoder):
    """Token Recycling (Luo et al. 2024): static-template tree from the adjacency matrix, greedy tree verification
    in the one tree loop; lossless (the committed tokens are the target's greedy tokens).

    Capabilities: family ``tree``; verify sizes (0 chain tokens, root + template nodes masked); no draft model; no
    sampling (the paper verifies greedily; a suite that samples is refused at validation). State recorded per
    sample: ``adjacency_bytes`` (vocab x k int32) and ``adjacency_rows`` (rows written).
    """

    Params = TokenRecyclingParams
    family = "tree"
    needs_draft = False
    lossless = True
    supports_sampling = False
    version = "1"

    def __init__(self, target, draft, params: TokenRecyclingParams):
        super().__init__(target, None, params)
        self.drafter: TokenRecyclingDrafter | None = None

    @classmethod
    def template_of(cls, params: TokenRecyclingParams) -> list[list[int]]:
        return TEMPLATES[params.template] if isinstance(params.template, str) else params.template

    @classmethod
    def verify_sizes(cls, params: TokenRecyclingParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification: (0, root + every template node), the full tree."""
        return 0, len(cls.template_of(params)) + 1

    @classmethod
    def reference(cls, params: TokenRecyclingParams | None = None):
        return ("ar", {})

    def state_stats(self) -> dict[str, int] | None:
        if self.drafter is None:
            return None
        rows = int((self.drafter.adjacency[:, 0] >= 0).sum())
        return {"adjacency_bytes": self.drafter.adjacency_bytes, "adjacency_rows": rows}

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int):
        """Run :func:`~dtbench.decoders.tree.speculate_tree` with a fresh :class:`TokenRecyclingDrafter`."""
        vocab = cast("PreTrainedModel", self.target).get_output_embeddings().weight.shape[0]
        self.drafter = TokenRecyclingDrafter(
            vocab, self.params.k, self.template_of(self.params), modelinfo.device_of(self.target)
        )
        yield from speculate_tree(
            self.target,
            None,
            input_ids,
            max_new_tokens,
            self.drafter,
            self.params.cache_strategy,
            tree_root="pending",
            eos_token_id=self.eos_token_id,
        )


__all__ = ["TEMPLATE_2_2_2", "TokenRecycling", "TokenRecyclingDrafter", "TokenRecyclingParams"]
