"""Greedy autoregressive decoding with a KV cache: the baseline every speedup is measured against."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dtbench.decoders import kv
from dtbench.decoders.base import Decoder, DecoderParams, Step, eos_ids, next_token


class ARParams(DecoderParams):
    """Autoregressive decoding has no hyperparameters."""


class Autoregressive(Decoder[ARParams]):
    """AR decoding: one target forward per token (paper section 4.3, "Autoregressive (AR)"); greedy, or sampled
    from the target's processed distribution when the suite samples.

    Each Step commits exactly one token; the first Step is the prefill (its time is the TTFT). With
    ``eos_token_id`` set it stops after the first EOS.
    """

    Params = ARParams
    needs_draft = False
    lossless = True
    supports_sampling = True
    family = "ar"
    batching = True
    batch_sampling = True
    compiles = True

    @classmethod
    def host_reads_bound(cls, params: ARParams, step: Step) -> int | None:
        """One read per iteration, the prefill's included (issue 46 item 1: the committed tokens come back in one
        read)."""
        return 1

    @classmethod
    def reference(cls, params: ARParams) -> tuple[str, dict[str, Any]] | None:
        return None  # it *is* the reference

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        eos = eos_ids(self.eos_token_id)
        cache, logits = kv.prefill(self.target, input_ids)
        token = next_token(logits, self.sampling, self.generator)
        yield Step(tokens=(token,))
        for _ in range(max_new_tokens - 1):
            if token in eos:
                return
            logits = kv.forward(self.target, [token], cache)
            token = next_token(logits[-1], self.sampling, self.generator)
            yield Step(tokens=(token,))

    @torch.inference_mode()
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """AR over B prompts together, greedy or sampled (``batch_sampling``): the one chain loop with no drafts (one
        batched target forward per token, every row its own position and cache length; a finished row leaves the
        batch)."""
        from dtbench.decoders.chain import NoDrafts, decoder_rows

        yield from decoder_rows(self, [NoDrafts() for _ in prompts], prompts, max_new_tokens, 0)
