"""Linear (chain) speculative decoding with greedy verification (Leviathan et al. 2023; paper section 4.3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field

from dtbench.decoders.base import Decoder, DecoderParams, Step
from dtbench.decoders.chain import DRAFT_FEEDS, DraftModelProposer, KVTarget, decoder_rows, speculate_chain


class LinearParams(DecoderParams):
    """Hyperparameters of linear speculation.

    Attributes:
        k: draft chain length K, tokens drafted per iteration (paper: K=8 on WikiText-2, K=5 on PG-19).
        fused_draft: compiled execution only: the K draft forwards of a full chain as ONE compiled region
            (:mod:`dtbench.decoders.draft_region`, issue 46 item 2) instead of K compiled forwards launched one by
            one from Python. Same tokens (the target verifies them as before); costs one compiled graph per feed
            width (1 and 2 ids) of K unrolled draft forwards in the compile step. Off by default (the paper's loop).
    """

    k: int = Field(5, ge=1, le=64, description="draft tokens per iteration (K)")
    fused_draft: bool = Field(
        False, description="compiled execution: the K draft forwards as one compiled region (issue 46 item 2)"
    )


class LinearSpeculative(Decoder[LinearParams]):
    """Draft K tokens greedily with the draft model, verify them in one target forward, commit the longest
    matching prefix plus the target's bonus token (:func:`~dtbench.decoders.chain.speculate_chain` with a
    :class:`~dtbench.decoders.chain.DraftModelProposer`; the target runs exactly one forward per iteration).
    """

    Params = LinearParams
    needs_draft = True
    lossless = True
    family = "chain"
    supports_sampling = True
    batching = True
    batch_sampling = True
    compiles = True

    @classmethod
    def host_reads_bound(cls, params: LinearParams, step: Step) -> int | None:
        """One read per iteration, the prefill's included (issue 46 item 1: the committed tokens come back in one
        read)."""
        return 1

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """K = 1, 3 and 8 (one draft, a short chain, the paper's WikiText-2 K)."""
        return [{"k": 1}, {"k": 3}, {"k": 8}]

    @classmethod
    def verify_sizes(cls, params: LinearParams) -> tuple[int, int]:
        """(K + 1, 0): the pending token and K drafts in one causal target forward."""
        return params.k + 1, 0

    @classmethod
    def compiled_sizes(cls, params: LinearParams) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """Target: every chain length up to K + 1 (the chain is cut short near T). Draft: 1 or 2 new tokens
        (:data:`~dtbench.decoders.chain.DRAFT_FEEDS`), never K + 1."""
        return None, DRAFT_FEEDS

    @classmethod
    def compiled_chains(cls, params: LinearParams) -> tuple[int, ...]:
        """(K,) with ``fused_draft``: the one chain length that runs as a compiled region; else ()."""
        return (params.k,) if params.fused_draft else ()

    @classmethod
    def eager_error(cls, params: LinearParams) -> str | None:
        if params.fused_draft:
            return "fused_draft fuses compiled draft forwards and has no eager form"
        return None

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        assert self.draft is not None  # needs_draft: the constructor refused a missing draft model
        yield from speculate_chain(
            KVTarget(self.target),
            DraftModelProposer(self.draft, fused=self.params.k if self.params.fused_draft else 0),
            input_ids,
            max_new_tokens,
            self.params.k,
            self.sampling,
            self.generator,
            self.eos_token_id,
        )

    @torch.inference_mode()
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """B prompts through the one chain loop, greedy or sampled (``batch_sampling``): one draft proposer per row,
        one batched target verification."""
        assert self.draft is not None  # needs_draft: the constructor refused a missing draft model
        yield from decoder_rows(
            self, [DraftModelProposer(self.draft) for _ in prompts], prompts, max_new_tokens, self.params.k
        )
