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
  cache (computed under the tree mask, i.e. with exactly their sequential context), so ``kv.keep_positions`` keeps
  them by index and drops the rest.
- ``rebuild`` (the paper's 3.5 / Algorithm 1 line 6): crop the target cache back to the prefix and re-run
  the committed tokens [root, path]: two target forwards per iteration.
- Two tree shapes (``tree_root``). ``paper`` (Algorithm 1 line 10): the draft's top-1 token after the
  prefix, u0, is the single drafted node of the first level and the paper's root, depth 0; D, D_0 and D_max
  count from u0, so a paper tree of depth D holds D + 1 drafted tokens on its longest path. u0 is verified
  like any node: if the target rejects it, the committed token is the target's own greedy token at the root
  position (``pred[0]``, the one-token fallback of SELECTCOMMIT). ``pending`` (a dtbench variant): the first
  drafted level is chosen by the same expansion rule as every other level (the pending token is expanded like
  any node, up to B_max children), and depths count drafted tokens after the pending one, so a chain of depth
  K is exactly linear speculation with K drafts. Internally both store the pending token as node 0 and drafted
  nodes at internal depth k >= 1 (k = drafted tokens on the path); the policies see the depth of the chosen
  convention, k - :func:`root_offset`.
- Pruning (3.3, p(u) < tau; ``prune``). ``leaf`` is Algorithm 1 (lines 14-16, 28): every top-B(u) child is
  added to the tree (until N_max) and verified; one whose path probability is below tau is never expanded, so
  it stays a leaf. ``skip`` (a dtbench variant) does not create such a child at all: p is non-increasing along
  a path, so a node below tau can only root a subtree below tau, and this is the tree left by iterated leaf
  pruning, without verifying the leaves. In ``paper`` mode u0 is always in the tree (line 10), whatever tau.
- The draft cache holds the committed prefix (root included) and then the expanded tree nodes in the order
  they were fed; after verification it keeps the accepted path's expanded nodes by index too (no draft
  recomputation). Path nodes that were leaves (never fed to the draft) are fed at the next iteration's root
  forward together with the new root.

Host/device synchronisation: one ``tolist()`` per expansion step (per level or per node) and one per
verification; masks, position ids, the ancestor matrix and path selection are tensor operations.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Annotated, ClassVar, Literal, TypeVar

import torch
from pydantic import Field, model_validator

from dtbench.decoders.base import Decoder, DecoderParams, Step
from dtbench.decoders.tree.draft import (  # noqa: F401
    SKIP_WITH_SAMPLING,
    DraftSession,
    ExpansionPolicy,
    TreeDrafter,
    TreeSampling,
    check_draft_options,
    draft_tree,
)
from dtbench.decoders.tree.loop import (  # noqa: F401  (the loop's names, re-exported)
    speculate_tree,
    speculate_tree_batch,
    speculate_tree_rows,
    tree_logits,
    tree_predictions,
)
from dtbench.decoders.tree.resident import Resident, draft_tree_resident, level_slots  # noqa: F401
from dtbench.decoders.tree.structure import (  # noqa: F401  (the toolkit's names, re-exported)
    CacheStrategy,
    DraftStrategy,
    MaskKind,
    Prune,
    SideBranch,
    TokenTree,
    TreeNode,
    TreeRoot,
    ancestor_matrix,
    attention_mask_kind,
    bfs_order,
    root_offset,
    select_path,
    tree_attention_mask,
    tree_capacity,
    tree_node_bound,
    tree_position_ids,
    with_side_branch,
)

# ----------------------------------------------------------------------------------------------------------
# Verification driver (Algorithm 1, one iteration; paper 3.4-3.5)
# ----------------------------------------------------------------------------------------------------------


class TreeParams(DecoderParams):
    """Hyperparameters every tree decoder shares.

    Attributes:
        tree_root: "paper" roots the tree at the draft's top-1 token u0 at depth 0 (Algorithm 1 line 10; D,
            D_0, D_max count from u0); "pending" expands the pending token like any node, depths counting
            drafted tokens after it (the dtbench v1 tree, one level shallower for the same D).
        prune: "leaf" keeps a child whose path probability is below tau as a verified, unexpanded leaf
            (Algorithm 1 lines 14-16, 28); "skip" never creates it (the dtbench v1 tree).
        cache_strategy: "compact" keeps the accepted path's target KV entries by index (one target forward
            per iteration); "rebuild" is the paper's crop-and-re-run (section 3.5; two target forwards).
        draft_strategy: "per_level" drafts a whole tree level in one draft forward with the tree mask;
            "per_node" runs one cached draft step per expanded node (the paper's Algorithm 1).
        tau: pruning threshold on cumulative draft path probability p(u) (paper 3.3; Table 1 uses 0.1);
            0 disables pruning.
        n_max: node budget N_max, drafted nodes per tree (paper Appendix A: 256). ``"auto"`` (an extension, not
            the paper's default): the runner sets it before the first cell to the largest calibrated n whose
            tree verification (root + n nodes, one target forward) costs at most ``n_max_factor`` x one AR token
            (:func:`dtbench.harness.calibration.curves.auto_budget`); the chosen value is stored in the cell's params.
        n_max_factor: the factor of ``n_max: "auto"`` (default 2.0); unused otherwise.

    Defaults: ``tree_root="paper"`` and ``prune="leaf"``, so a bare ``{name: dynatree}`` or ``{name: fixed_tree}``
    is the paper's construction. Until decoder version 2 the only behaviour was pending/skip; cells store
    the decoder version, so stored version-1 results (whose params JSON has neither key) keep their meaning.

    The default strategies (compact, per_level) are the fastest lossless combination measured by
    ``suites/tree-strategies.yaml`` on the embedded SmolLM2 pair (CPU); they also run the fewest forwards
    (1 target forward per iteration, one draft forward per tree level), which matters more on a GPU.
    """

    tree_root: TreeRoot = Field(
        "paper",
        description="'paper': rooted at the draft's top-1 token u0, depth 0 (Algorithm 1 line 10); "
        "'pending': the pending token expanded like any node",
    )
    prune: Prune = Field(
        "leaf",
        description="'leaf': a child with p < tau is a verified leaf (Algorithm 1 lines 14-16); "
        "'skip': it is not created",
    )
    cache_strategy: CacheStrategy = Field(
        "compact", description="target cache update: 'compact' (keep path KV, 1 forward) or 'rebuild' (paper, 2)"
    )
    draft_strategy: DraftStrategy = Field(
        "per_level", description="'per_level' (one draft forward per depth) or 'per_node' (paper, one per node)"
    )
    tau: float = Field(0.1, ge=0.0, lt=1.0, description="pruning threshold on cumulative path probability p(u)")
    n_max: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        256,
        description="node budget N_max (drafted nodes per tree); 'auto': chosen by the runner from "
        "the calibrated verify curve (harness/calibration/curves.py auto_budget; an extension, not the paper's)",
    )
    n_max_factor: float = Field(
        2.0,
        gt=1.0,
        le=1000.0,
        description="n_max: auto takes the largest n whose tree verify costs at most this many times one AR token",
    )
    resident: Resident = Field(
        "off",
        description="where drafting decides (same tree, same tokens; decoders/tree/resident.py): 'off': on the host, "
        "one device-to-host read per drafted level; 'draft': on the device, every level padded to its static "
        "bound and run, the tree's size read before verification (2 reads per iteration); 'full': the "
        "capacity-padded tree verified too (1 read per iteration)",
    )

    @model_validator(mode="after")
    def _resident_per_level(self) -> TreeParams:
        if self.resident != "off" and self.draft_strategy != "per_level":
            raise ValueError(f"resident: {self.resident} drafts per_level (draft_strategy: {self.draft_strategy})")
        return self


N_MAX_AUTO_CEILING = 256  # n_max: auto chooses at most this many drafted nodes (the paper's N_max)

TP = TypeVar("TP", bound=TreeParams)  # a tree decoder's params model


def resolved_n_max(params: TreeParams) -> int:
    """``params.n_max`` as an int: ``"auto"`` is replaced by the calibrated budget before any cell decodes (the
    runner, :func:`dtbench.harness.calibration.curves.auto_budget`), so an expansion policy never sees it."""
    assert params.n_max != "auto", "n_max: auto is resolved before the first cell"
    return params.n_max


class TreeDecoder(Decoder[TP]):
    """Base of the tree speculative decoders: subclasses only build their :class:`ExpansionPolicy`.

    Lossless for greedy decoding (paper 3.6): the committed tokens equal the target's greedy tokens. Lossless
    under sampling too (issue 13): multi-draft speculative sampling over the tree (:func:`speculate_tree`), the
    committed tokens distributed exactly as the target's processed distribution; ``prune: skip`` is refused then.
    """

    Params: ClassVar[type[DecoderParams]] = TreeParams
    needs_draft = True
    lossless = True
    supports_sampling = True
    family = "tree"
    batching = True
    compiles = True
    version = "2"  # 2: tree_root/prune options, defaults paper/leaf (1: the pending/skip tree only)

    @classmethod
    def host_reads_bound(cls, params: TP, step: Step) -> int | None:
        """``resident: full`` one read per iteration, ``draft`` two (the tree's size, then the path); ``off`` one
        per drafted level and one to select the path (1 + max(depth, 1)); None for the paper's per-node drafting and
        crop-and-re-run cache (not bounded yet)."""
        if params.draft_strategy != "per_level" or params.cache_strategy != "compact":
            return None
        return {"full": 1, "draft": 2}.get(params.resident, 1 + max(step.depth, 1))

    @classmethod
    @abstractmethod
    def tree_bounds(cls, params: TP) -> tuple[int, int]:
        """(largest breadth B, largest depth D) a tree of this configuration can have (params only)."""

    @classmethod
    def verify_sizes(cls, params: TP) -> tuple[int, int]:
        """(1, root + nodes): the largest tree :func:`~dtbench.decoders.tree.structure.tree_node_bound` allows for
        :meth:`tree_bounds`, the tree root and N_max (``n_max: auto`` searches up to :data:`N_MAX_AUTO_CEILING`)."""
        first, breadth, depth_cap, n_max = cls._bounds(params)
        return 1, tree_node_bound(first, breadth, depth_cap, n_max)

    @classmethod
    def cache_headroom(cls, params: TP) -> int:
        """Positions a cache takes beyond the committed tokens: the verified tree, or with resident drafting the
        draft cache's padded levels (:func:`~dtbench.decoders.tree.resident.level_slots`) if more."""
        masked = cls.verify_sizes(params)[1]
        if getattr(params, "resident", "off") == "off":
            return masked
        first, breadth, depth_cap, n_max = cls._bounds(params)
        return max(masked, sum(level_slots(first, breadth, depth_cap, n_max)))

    @classmethod
    def _bounds(cls, params: TP) -> tuple[int, int, int, int]:
        """(nodes at depth 1, largest breadth, depth cap in drafted tokens, N_max) of a configuration."""
        breadth, depth = cls.tree_bounds(params)
        breadth = max(breadth, 1)
        n_max = N_MAX_AUTO_CEILING if params.n_max == "auto" else int(params.n_max)
        offset = root_offset(params.tree_root)
        return (1 if params.tree_root == "paper" else breadth), breadth, max(depth, 1) + offset, n_max

    @abstractmethod
    def make_policy(self) -> ExpansionPolicy:
        """A fresh expansion policy for one generate() call (adaptive state starts from the params)."""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Run :func:`speculate_tree` with this decoder's policy and strategies (see there for the Steps)."""
        p = self.params
        yield from speculate_tree(
            self.target,
            self.draft,
            input_ids,
            max_new_tokens,
            self.make_policy(),
            p.cache_strategy,
            p.draft_strategy,
            tree_root=p.tree_root,
            prune=p.prune,
            sampling=self.sampling,
            generator=self.generator,
            eos_token_id=self.eos_token_id,
            resident=p.resident,
        )

    @torch.inference_mode()
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """B prompts through :func:`speculate_tree_batch`: a fresh policy and draft session per row, every row's
        tree verified in one batched target forward."""
        p = self.params
        assert self.draft is not None  # needs_draft: Decoder.__init__ refuses a missing draft model
        yield from speculate_tree_batch(
            self.target,
            self.draft,
            prompts,
            max_new_tokens,
            [self.make_policy() for _ in prompts],
            p.cache_strategy,
            p.draft_strategy,
            tree_root=p.tree_root,
            prune=p.prune,
            eos_token_id=self.eos_token_id,
        )

    @classmethod
    def sampling_error(cls, params: DecoderParams) -> str | None:
        """``prune: skip`` cannot sample losslessly (it drops children by their drawn value); resident drafting is
        greedy."""
        if getattr(params, "prune", None) == "skip":
            return SKIP_WITH_SAMPLING
        if getattr(params, "resident", "off") != "off":
            return "resident drafting is greedy; use resident: off to sample"
        return None

    @classmethod
    def batching_error(cls, params: DecoderParams) -> str | None:
        """Resident drafting decodes one row at a time (B = 1)."""
        if getattr(params, "resident", "off") != "off":
            return "resident drafting decodes one row at a time; use resident: off at B > 1"
        return None
