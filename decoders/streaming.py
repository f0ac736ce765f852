"""StreamingLLM (attention sinks) decoding, autoregressive and speculative (paper section 4.3, Table 1).

StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks", sections 3.2-3.3)
keeps the key/value entries of the first ``S`` tokens (the *attention sinks*) and of the most recent tokens and
evicts everything in between, with positions assigned within the cache. The cache policy, its exactness under
speculation and the supported models are documented with the cache itself, :mod:`dtbench.decoders.streaming_kv`.
``streaming_spec`` is linear speculation (:func:`~dtbench.decoders.chain.speculate_chain`) over two such caches;
its output equals ``streaming_ar``'s with the same S and R token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import Field

from dtbench.decoders.base import Decoder, DecoderParams, Step, eos_ids, next_token
from dtbench.decoders.chain import ChainTarget, DraftModelProposer, speculate_chain
from dtbench.decoders.streaming_kv import (  # noqa: F401  (re-exported for tests and plugins)
    PREFILL_CHUNK,
    SUPPORTED_ATTENTION,
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    Rope,
    StreamingKV,
)


class StreamingParams(DecoderParams):
    """Cache policy shared by both StreamingLLM decoders.

    Attributes:
        sinks: S, attention-sink tokens kept (StreamingLLM uses 4).
        window: R, most recent tokens each query attends to, itself included; S + R = 1024 reproduces the paper's
            cache size.
    """

    sinks: int = Field(4, ge=0, le=1024, description="attention-sink tokens kept (S)")
    window: int = Field(1020, ge=1, le=1 << 20, description="recent tokens attended to, itself included (R)")


class StreamingSpecParams(StreamingParams):
    """Streaming policy plus the draft chain length.

    Attributes:
        k: draft tokens per iteration (K).
    """

    k: int = Field(5, ge=1, le=64, description="draft tokens per iteration (K)")


def _check(models: list[torch.nn.Module | None]) -> None:
    for model in models:
        if model is not None:
            Rope(model)


class StreamingAR(Decoder):
    """Greedy autoregressive decoding under the StreamingLLM cache policy (Xiao et al. 2024; paper section 4.3).

    One target forward per token; the first Step is the prefill. Lossy with respect to full-cache ``ar`` once
    the sequence is longer than S + R; with ``window`` large enough that nothing is ever evicted it is ``ar``.
    Its reference is ``ar`` (the runner records where it diverges), and it is the reference of
    :class:`StreamingSpeculative`.

    Raises:
        ValueError: (constructor) for unsupported models (see the module docstring).
    """

    Params = StreamingParams
    needs_draft = False
    lossless = False

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """A window wider than any checked text (nothing evicted) and one that evicts."""
        return [{"sinks": 4, "window": 64}, {"sinks": 2, "window": 12}]

    supports_sampling = True
    family = "ar"

    @classmethod
    def verify_sizes(cls, params: StreamingParams) -> tuple[int, int]:
        """(1, 1): one token per forward, through the streaming cache's explicit 4D mask."""
        return 1, 1

    def __init__(self, target, draft, params):
        super().__init__(target, draft, params)
        _check([target])

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        eos = eos_ids(self.eos_token_id)
        state = StreamingKV(self.target, self.params.sinks, self.params.window)
        logits, _ = state.forward(input_ids[0].tolist(), last_only=True)
        state.enforce_budget()
        token = next_token(logits[-1], self.sampling, self.generator)
        yield Step(tokens=(token,))
        for _ in range(max_new_tokens - 1):
            if token in eos:
                return
            logits, _ = state.forward([token])
            state.enforce_budget()
            token = next_token(logits[-1], self.sampling, self.generator)
            yield Step(tokens=(token,))


class StreamingSpeculative(Decoder):
    """Linear speculative decoding with both caches under the StreamingLLM policy (paper section 4.3, Table 1).

    Drafts K tokens greedily with the draft model, verifies them in one target forward with the exact streaming
    attention of the module docstring, commits the longest matching prefix plus the target's bonus token.
    Its output equals :class:`StreamingAR`'s with the same S and R token for token (that is its ``reference``);
    it is lossy with respect to full-cache ``ar``.

    Raises:
        ValueError: (constructor) without a draft model, or for unsupported models.
    """

    Params = StreamingSpecParams
    needs_draft = True
    lossless = False

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """As streaming_ar's, K = 3."""
        return [{"sinks": 4, "window": 64, "k": 3}, {"sinks": 2, "window": 12, "k": 3}]

    supports_sampling = True
    family = "chain"

    @classmethod
    def verify_sizes(cls, params: StreamingSpecParams) -> tuple[int, int]:
        """(K + 1, K + 1): the pending token and K drafts, verified with the streaming cache's 4D mask (priced on
        the masked curve; the causal curve up to K + 1 gives the cost model its chain length)."""
        return params.k + 1, params.k + 1

    def __init__(self, target, draft, params):
        super().__init__(target, draft, params)
        _check([target, draft])

    @classmethod
    def reference(cls, params: StreamingSpecParams) -> tuple[str, dict[str, Any]]:
        """``("streaming_ar", {"sinks": S, "window": R})``: same policy, no speculation."""
        return ("streaming_ar", {"sinks": params.sinks, "window": params.window})

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        S, R = self.params.sinks, self.params.window
        assert self.draft is not None  # needs_draft: Decoder.__init__ refuses a missing draft model
        yield from speculate_chain(
            StreamingTarget(self.target, S, R),
            StreamingDraftProposer(self.draft, S, R),
            input_ids,
            max_new_tokens,
            self.params.k,
            self.sampling,
            self.generator,
            self.eos_token_id,
        )


class StreamingTarget(ChainTarget):
    """The target's side of streaming speculation: a :class:`StreamingKV`, verified tentatively (nothing a
    rollback may need is evicted until the verdict), cropped to the kept tokens, then trimmed to ``S + R``."""

    def __init__(self, model: torch.nn.Module, sinks: int, window: int):
        self.state = StreamingKV(model, sinks, window)
        self._before = 0

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits, _ = self.state.forward(input_ids[0].tolist(), last_only=True)
        self.state.enforce_budget()
        return logits[-1]

    def verify(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        self._before = self.state.n  # committed tokens before the pending one
        ids = tokens if isinstance(tokens, list) else tokens.view(-1).tolist()  # StreamingKV takes host ids
        return self.state.forward(ids, tentative=True)[0]

    def keep(self, n: int) -> None:
        self.state.crop(self._before + n)
        self.state.enforce_budget()


class StreamingDraftProposer(DraftModelProposer):
    """:class:`~dtbench.decoders.chain.DraftModelProposer` over a draft :class:`StreamingKV`: committed tokens
    (the backlog) are fed exactly; tentative drafts are not evicted within a round, so a crop rolls them back."""

    resident = False  # StreamingKV feeds host token ids (its eviction policy tracks them)

    def __init__(self, draft: torch.nn.Module, sinks: int, window: int):
        super().__init__(draft)
        self.sinks, self.window = sinks, window

    def begin(self, prompt: list[int], pending: int) -> None:
        super().begin(prompt, pending)
        self.state = StreamingKV(self.draft, self.sinks, self.window)

    def forward(self, feed: list[int] | torch.Tensor, exact: bool) -> torch.Tensor:
        assert isinstance(feed, list), "resident = False: the chain loop feeds host ids"
        return self.state.forward(feed, exact=exact, last_only=True)[0][-1]

    def rollback(self, length: int) -> None:
        self.state.crop(length)
        self.state.enforce_budget()

    def cached(self) -> int:
        return self.state.n
