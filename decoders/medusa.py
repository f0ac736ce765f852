"""Medusa-1: several heads on the target's last hidden state draft a static tree (Cai et al. 2024).

Reference read: FasterDecoding/Medusa ``medusa/model/medusa_model.py`` (heads, loading), ``medusa/model/utils.py``
(``generate_medusa_buffers``: choices sorted by (length, path); ``generate_candidates``: TOPK = 10 tokens per head,
the node for choice path (c_1, ..., c_d) is head d's rank-c_d token) and ``medusa/model/medusa_choices.py``
(``mc_sim_7b_63``, the default tree for 7B models). Verification is greedy through the one tree loop
(:func:`~dtbench.decoders.tree.speculate_tree`). Sampling only through Medusa's "typical acceptance"
(``acceptance: typical``, issue 34 item 2), an opt-in mode that is LOSSY BY DESIGN: the cell's ``lossless_expected``
is False and every report's Lossless column says "lossy by design"
(:func:`~dtbench.decoders.sampling.verify_tree_typical`; ``evaluate_posterior(sampling="typical")`` and
``get_typical_one_token`` in ``medusa/model/utils.py``). A suite that samples without asking for it by name is
refused.

Mapping onto dtbench's loop: the tree is rooted at the pending token x_{t+1} (the target's greedy token from the
feature at position t, Medusa's "base model token"); head i's top-k at that same feature gives the nodes at depth
i + 1. The feature comes from the verify forward that committed x_{t+1} (no extra target forward).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import torch
from pydantic import Field

from dtbench.decoders import modelinfo
from dtbench.decoders.base import DecoderParams, Step
from dtbench.decoders.heads import HeadDecoder
from dtbench.decoders.medusa_head import MedusaHeads, check_medusa, load_medusa
from dtbench.decoders.tree import TreeDrafter, speculate_tree
from dtbench.decoders.tree.structure import CacheStrategy, TokenTree

# medusa/model/medusa_choices.py, mc_sim_7b_63 (the reference's default for Vicuna-7B), verbatim.
MC_SIM_7B_63 = [
    [0],
    [0, 0],
    [1],
    [0, 1],
    [2],
    [0, 0, 0],
    [1, 0],
    [0, 2],
    [3],
    [0, 3],
    [4],
    [0, 4],
    [2, 0],
    [0, 5],
    [0, 0, 1],
    [5],
    [0, 6],
    [6],
    [0, 7],
    [0, 1, 0],
    [1, 1],
    [7],
    [0, 8],
    [0, 0, 2],
    [3, 0],
    [0, 9],
    [8],
    [9],
    [1, 0, 0],
    [0, 2, 0],
    [1, 2],
    [0, 0, 3],
    [4, 0],
    [2, 1],
    [0, 0, 4],
    [0, 0, 5],
    [0, 0, 0, 0],
    [0, 1, 1],
    [0, 0, 6],
    [0, 3, 0],
    [5, 0],
    [1, 3],
    [0, 0, 7],
    [0, 0, 8],
    [0, 0, 9],
    [6, 0],
    [0, 4, 0],
    [1, 4],
    [7, 0],
    [0, 1, 2],
    [2, 0, 0],
    [3, 1],
    [2, 2],
    [8, 0],
    [0, 5, 0],
    [1, 5],
    [1, 0, 1],
    [0, 2, 1],
    [9, 0],
    [0, 6, 0],
    [0, 0, 0, 1],
    [1, 6],
    [0, 7, 0],
]
MEDUSA_CHOICES = {"mc_sim_7b_63": MC_SIM_7B_63}
Rank = Annotated[int, Field(ge=0, le=1023)]


def static_tree(choices: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Medusa's static tree in BFS order (``generate_medusa_buffers``: sorted by (length, path)).

    Args:
        choices: paths of top-k ranks, one per drafted node; every prefix of a path must be a path too.

    Returns:
        (paths sorted BFS, parent of each as an index into that list, -1 for the root's children).

    Raises:
        ValueError: a path whose prefix is missing, a repeated path or a negative rank.
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if len(paths) != len(choices) or any(r < 0 for c in paths for r in c) or any(not c for c in paths):
        raise ValueError("medusa choices must be distinct, non-empty paths of ranks >= 0")
    index = {c: i for i, c in enumerate(paths)}
    parents = []
    for c in paths:
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"medusa choice {list(c)} lacks its parent {list(c[:-1])}")
        parents.append(index[c[:-1]] if len(c) > 1 else -1)
    return paths, parents


class MedusaDrafter(TreeDrafter):
    """Drafts Medusa's static tree from the heads' top-k at the target's last feature (greedy).

    Attributes:
        typical: (posterior_threshold, posterior_alpha) when the tree loop verifies with Medusa's typical acceptance
            (lossy by design); None: greedy verification.
    """

    typical: tuple[float, float] | None = None

    def __init__(self, heads: MedusaHeads, choices: list[list[int]], hidden_layer: int):
        """Args: heads: loaded heads; choices: rank paths (deeper than the heads are dropped); hidden_layer:
        the target's ``num_hidden_layers`` (its final-normed last hidden state)."""
        self.heads = heads
        usable = [c for c in choices if len(c) <= len(heads.heads)]
        self.paths, self.parents = static_tree(usable)
        self.hidden_layers = (hidden_layer,)
        self.top_k = max(r for c in self.paths for r in c) + 1
        self.max_breadth = max(self.parents.count(p) for p in set(self.parents))
        self.n_max = len(self.paths)
        self.depth_limit = max(len(c) for c in self.paths)
        self.feature: torch.Tensor | None = None

    def feed_target(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        self.feature = features[-1:]  # the feature that predicted the pending token

    def draft(self, tree: TokenTree, root: int, depth_cap: int) -> None:
        """Add every choice no deeper than ``depth_cap``: node (c_1..c_d) = head d's rank-c_d token."""
        assert self.feature is not None, "the tree loop feeds the target's features before every draft"
        logits = self.heads(inputs_embeds=self.feature.unsqueeze(0))[:, 0]  # (heads, vocab)
        logp, tokens = torch.log_softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        logp, tokens = logp.to(tree.device), tokens.to(tree.device)
        node_of: dict[int, int] = {}  # index into self.paths -> its node in the tree
        for d in range(1, depth_cap + 1):
            level = [i for i, c in enumerate(self.paths) if len(c) == d]
            level = level[: tree.budget_left]
            if not level:
                break
            ranks = torch.tensor([self.paths[i][-1] for i in level], device=tree.device)
            parents = torch.tensor(
                [node_of[self.parents[i]] if self.parents[i] >= 0 else 0 for i in level], device=tree.device
            )
            lp = logp[d - 1, ranks]
            new = tree.add(parents, tokens[d - 1, ranks], lp, tree.cum_logp[parents] + lp, d)
            node_of.update(zip(level, new))


class MedusaParams(DecoderParams):
    """Hyperparameters of ``medusa``.

    Attributes:
        head: a local folder or hub id holding ``config.json`` (medusa_num_heads, medusa_num_layers) and
            ``medusa_lm_head.pt`` (e.g. FasterDecoding/medusa-vicuna-7b-v1.3).
        choices: the static tree: a name from the reference's ``medusa_choices`` (``mc_sim_7b_63``, its 7B default)
            or an explicit list of rank paths.
        cache_strategy: the tree loop's target cache update (see :class:`~dtbench.decoders.tree.TreeParams`).
        acceptance: ``greedy`` (lossless; the default) or ``typical`` (Medusa's typical acceptance under sampling,
            lossy by design; only with a suite that samples).
        posterior_threshold, posterior_alpha: typical acceptance's cutoff min(threshold, alpha * exp(-entropy));
            the reference's defaults (``medusa_generate``: 0.09 and 0.3).
    """

    head: str = Field(..., min_length=1, description="Medusa head: local folder or hub id (medusa_lm_head.pt)")
    choices: (
        Literal["mc_sim_7b_63"] | Annotated[list[Annotated[list[Rank], Field(min_length=1)]], Field(min_length=1)]
    ) = Field("mc_sim_7b_63", description="static tree: 'mc_sim_7b_63' or a list of top-k rank paths")
    cache_strategy: CacheStrategy = Field("compact", description="'compact' (1 target forward) or 'rebuild'")
    acceptance: Literal["greedy", "typical"] = Field(
        "greedy", description="'greedy' (lossless) or 'typical' (Medusa's typical acceptance: LOSSY by design)"
    )
    posterior_threshold: Annotated[float, Field(gt=0, le=1)] = Field(0.09, description="typical: threshold")
    posterior_alpha: Annotated[float, Field(gt=0, le=1)] = Field(0.3, description="typical: alpha")


class Medusa(HeadDecoder):
    """Medusa-1 decoding: static tree from learned heads in the one tree loop; lossless greedy, or Medusa's typical
    acceptance under sampling (opt-in, lossy by design).

    Capabilities (:class:`~dtbench.decoders.heads.HeadDecoder`): family ``tree``; verify sizes (0 chain tokens,
    root + tree nodes masked); sampling only with ``acceptance: typical`` (refused otherwise; lossy by design:
    ``lossless_expected`` False, reported "lossy by design"). The heads' forward is the decoder's draft forward.
    """

    Params = MedusaParams
    version = "1"
    supports_sampling = True  # only with acceptance: typical (sampling_error), lossy by design
    load_head = staticmethod(load_medusa)
    check_head = staticmethod(check_medusa)

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """A Medusa-1 head in the published format (random weights) sized for the context's target."""
        return [{"head": ctx.medusa_head()}]

    @classmethod
    def lossless_with(cls, params: MedusaParams) -> bool:
        """False with ``acceptance: typical`` (lossy by design), else True."""
        return params.acceptance != "typical"

    @classmethod
    def sampling_error(cls, params: MedusaParams) -> str | None:
        """Sampling is refused unless the suite asks for Medusa's lossy typical acceptance by name."""
        if params.acceptance != "typical":
            return (
                "medusa samples only with its typical acceptance, which is lossy by design; "
                "ask for it with params: {acceptance: typical}"
            )
        return None

    @classmethod
    def choices_of(cls, params: MedusaParams) -> list[list[int]]:
        return MEDUSA_CHOICES[params.choices] if isinstance(params.choices, str) else params.choices

    @classmethod
    def verify_sizes(cls, params: MedusaParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification: (0, root + all choices) (the full tree; heads
        fewer than the deepest choice shrink it at run time)."""
        return 0, len(cls.choices_of(params)) + 1

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int):
        """Run :func:`speculate_tree` with a :class:`MedusaDrafter`: greedy, or typical acceptance when sampling.

        Raises:
            ValueError: ``acceptance: typical`` without sampling (typical acceptance needs a temperature > 0).
        """
        p = self.params
        if p.acceptance == "typical" and self.sampling is None:
            raise ValueError("medusa acceptance: typical needs a suite that samples (sampling: {temperature: ...})")
        heads = cast(MedusaHeads, self.draft)  # HeadDecoder.__init__: load_medusa's module
        drafter = MedusaDrafter(heads, self.choices_of(p), modelinfo.config_of(self.target).num_hidden_layers)
        if p.acceptance == "typical":
            drafter.typical = (p.posterior_threshold, p.posterior_alpha)
        yield from speculate_tree(
            self.target,
            None,
            input_ids,
            max_new_tokens,
            drafter,
            self.params.cache_strategy,
            tree_root="pending",
            sampling=self.sampling,
            generator=self.generator,
            eos_token_id=self.eos_token_id,
        )


__all__ = ["MC_SIM_7B_63", "Medusa", "MedusaDrafter", "MedusaParams", "Step", "static_tree"]
