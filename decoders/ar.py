"""Greedy autoregressive decoding with a KV cache: the baseline every speedup is measured against."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dtbench.decoders import kv
from dtbench.decoders.base import Decoder, DecoderParams, Step, greedy_token


class ARParams(DecoderParams):
    """Autoregressive decoding has no hyperparameters."""


class Autoregressive(Decoder):
    """Greedy AR decoding: one target forward per token (paper section 4.3, "Autoregressive (AR)").

    Each Step commits exactly one token; the first Step is the prefill (its time is the TTFT).
    """

    Params = ARParams
    needs_draft = False
    lossless = True

    def reference(self):
        return None  # it *is* the reference

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        cache, logits = kv.prefill(self.target, input_ids)
        token = greedy_token(logits)
        yield Step(tokens=(token,))
        for _ in range(max_new_tokens - 1):
            logits = kv.forward(self.target, [token], cache)
            token = greedy_token(logits[-1])
            yield Step(tokens=(token,))
