"""Linear (chain) speculative decoding with greedy verification (Leviathan et al. 2023; paper section 4.3)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from pydantic import Field

from dtbench.decoders import kv
from dtbench.decoders.base import Decoder, DecoderParams, Step, greedy_token, verify_chain


class LinearParams(DecoderParams):
    """Hyperparameters of linear speculation.

    Attributes:
        k: draft chain length K, tokens drafted per iteration (paper: K=8 on WikiText-2, K=5 on PG-19).
    """

    k: int = Field(5, ge=1, le=64, description="draft tokens per iteration (K)")


class LinearSpeculative(Decoder):
    """Draft K tokens greedily with the draft model, verify them in one target forward, commit the longest
    matching prefix plus the target's bonus token.

    State between iterations: the target cache holds every committed token except the newest (the bonus
    token, the first input of the next iteration); the draft cache holds them except a short backlog (the
    bonus, and the last draft when all K were accepted, since it was never fed). Rejected drafts sit at the
    tail of both caches, so a crop rolls them back; the target runs exactly one forward per iteration.
    """

    Params = LinearParams
    needs_draft = True
    lossless = True

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        k = self.params.k
        # Invariant between iterations: the target cache holds every committed token except the newest one
        # (`pending`); the draft cache holds every committed token except `draft_backlog`.
        t_cache, logits = kv.prefill(self.target, input_ids)
        pending = greedy_token(logits)
        yield Step(tokens=(pending,))
        d_cache = kv.new_cache()
        draft_backlog = input_ids[0].tolist() + [pending]
        produced = 1
        while produced < max_new_tokens:
            # At most T - produced - 1 drafts: with the bonus token the iteration then commits at most T - produced.
            n_draft = min(k, max_new_tokens - produced - 1)
            prefix_len = kv.cache_len(t_cache)
            drafts: list[int] = []
            feed = draft_backlog
            for _ in range(n_draft):
                token = greedy_token(kv.forward(self.draft, feed, d_cache, last_only=True)[-1])
                drafts.append(token)
                feed = [token]
            # Verify pending + drafts in one target forward; logits[i] predicts the token after input i.
            logits = kv.forward(self.target, [pending, *drafts], t_cache)
            accepted, committed = verify_chain(drafts, logits)
            bonus = committed[-1]
            # Rejected drafts sit at the tails of both caches: a crop rolls them back.
            kv.crop(t_cache, prefix_len + 1 + accepted)
            d_len = kv.cache_len(d_cache)  # = prefix_len + n_draft: the last draft was never fed
            kv.crop(d_cache, min(d_len, prefix_len + 1 + accepted))
            draft_backlog = ([drafts[-1]] if drafts and accepted == n_draft else []) + [bonus]
            pending = bonus
            produced += len(committed)
            yield Step(tokens=committed, drafted=n_draft, accepted=accepted, tree_size=n_draft, depth=n_draft)
