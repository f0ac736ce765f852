"""N-gram (prompt lookup) speculative decoding: drafts copied from the context, no draft model, no training.

Prompt lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding) as vLLM implements it
(reference read, from memory of the public code: ``vllm/v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens``): the token sequence (prompt + output) is reversed and one
Knuth-Morris-Pratt pass with a failure table capped at ``max_n`` finds the longest suffix of the sequence, between
``min_n`` and ``max_n`` tokens, that also occurs earlier; the ``k`` tokens that followed that earlier occurrence
are the draft. One pass is linear in the context length per step (no rescan per n). Verification is the one chain
loop's (:func:`~dtbench.decoders.chain.speculate_chain`): greedy, or speculative sampling with the deterministic
drafts treated as drawn with probability 1, so the output equals the target's (Leviathan et al. 2023).

The example plugin ``prompt_lookup`` (examples/dtbench-prompt-lookup) stays the example of a third-party decoder;
this is the built-in method, with vLLM's search and its choice of occurrence as a named parameter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from dtbench.decoders.base import Decoder, DecoderParams, Step
from dtbench.decoders.chain import KVTarget, Proposer, decoder_rows, speculate_chain

Occurrence = Literal["earliest", "latest"]


def longest_suffix_match(
    tokens: list[int], min_n: int, max_n: int, occurrence: Occurrence = "earliest"
) -> tuple[int, int]:
    """The longest suffix of ``tokens`` (at most ``max_n`` long) that also occurs earlier, by KMP (vLLM's search).

    The sequence is reversed, so a suffix of ``tokens`` is a prefix of the reversed sequence; the KMP failure
    table of that prefix is kept only up to ``max_n`` entries (a match reaching ``max_n`` falls back through it and
    the scan goes on), so one O(len(tokens)) pass visits every earlier occurrence of every suffix length.

    Args:
        tokens: the context (prompt + committed output), token ids.
        min_n, max_n: shortest and longest suffix matched (1 <= min_n <= max_n).
        occurrence: among earlier occurrences of the longest matched suffix, the ``earliest`` in the context
            (vLLM's and transformers' choice) or the ``latest`` (the example plugin's).

    Returns:
        (n, start): the matched suffix length and the index in ``tokens`` of the token that followed that earlier
        occurrence (``start < len(tokens)``); (0, 0) when no suffix of ``min_n`` tokens or more recurs.
    """
    total = len(tokens)
    if total < 2 or total <= min_n:
        return 0, 0
    rev = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    later = occurrence == "earliest"  # reversed index grows towards the start of the context
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev > longest or (later and prev == longest):
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return 0, 0
    return longest, total - 1 - position + longest


class NgramProposer(Proposer):
    """Chain drafts from :func:`longest_suffix_match` over the committed text (prompt included).

    State: the committed token list (``state_bytes``: its list storage, the only memory the method keeps).
    """

    def __init__(self, min_n: int, max_n: int, occurrence: Occurrence):
        self.min_n, self.max_n, self.occurrence = min_n, max_n, occurrence
        self.tokens: list[int] = []
        self.matches = 0  # proposals made (steps whose lookup found a match)

    def begin(self, prompt: list[int], pending: int) -> None:
        self.tokens = [*prompt, pending]

    def propose(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        n, start = longest_suffix_match(self.tokens, self.min_n, self.max_n, self.occurrence)
        if not n:
            return []
        self.matches += 1
        return self.tokens[start : start + max_tokens]

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        self.tokens.extend(committed)

    def state(self) -> dict[str, int]:
        """What the method stored: the context (tokens, and its list's bytes by ``sys.getsizeof``: pointers only,
        small ints are shared) and how many lookups found a match."""
        return {
            "context_tokens": len(self.tokens),
            "context_bytes": sys.getsizeof(self.tokens),
            "lookup_matches": self.matches,
        }


class NgramParams(DecoderParams):
    """Hyperparameters of ``ngram`` (defaults: the prompt-lookup reference's ``max_ngram_size=3``,
    ``num_pred_tokens=10``, matching suffixes down to one token as it does).

    Attributes:
        k: draft tokens copied after the match and verified per iteration (vLLM ``num_speculative_tokens``,
            transformers ``prompt_lookup_num_tokens``).
        min_n, max_n: shortest and longest context suffix matched (vLLM ``prompt_lookup_min`` / ``_max``).
        occurrence: which earlier occurrence of the longest matched suffix supplies the draft: ``earliest``
            (vLLM, transformers) or ``latest`` (the most recent one, the example plugin's).
    """

    k: int = Field(10, ge=1, le=128, description="draft tokens per iteration (K)")
    min_n: int = Field(1, ge=1, le=64, description="shortest context suffix matched")
    max_n: int = Field(3, ge=1, le=64, description="longest context suffix matched")
    occurrence: Occurrence = Field(
        "earliest",
        description="'earliest' (vLLM, transformers) or 'latest' occurrence of the matched suffix supplies the draft",
    )

    @model_validator(mode="after")
    def _ordered(self) -> NgramParams:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


class Ngram(Decoder[NgramParams]):
    """N-gram / prompt lookup speculative decoding on the one chain loop; lossless (greedy and sampled).

    Capabilities: family ``chain``; verify sizes (K + 1 chain tokens, 0 masked); sampling by speculative sampling
    with deterministic drafts (exact for any draft source). The first Step is the prefill; a Step whose lookup
    found nothing verifies no draft and commits one token (``drafted = 0``).
    """

    Params = NgramParams
    family = "chain"
    needs_draft = False
    lossless = True
    supports_sampling = True
    batching = True
    batch_sampling = True
    compiles = True
    version = "1"

    @classmethod
    def host_reads_bound(cls, params: NgramParams, step: Step) -> int | None:
        """One read per iteration, the prefill's included (issue 46 item 1: the committed tokens come back in one
        read)."""
        return 1

    @classmethod
    def check_settings(cls, ctx: Any) -> Any:
        """K = 4 (default lookup) and K = 1."""
        return [{"k": 4}, {"k": 1}]

    @classmethod
    def verify_sizes(cls, params: NgramParams) -> tuple[int, int]:
        """(chain tokens, masked tokens) of one verification: the pending token and K drafts."""
        return params.k + 1, 0

    def state_stats(self) -> dict[str, int] | None:
        """The last generate() call's state (:meth:`NgramProposer.state`), None before one."""
        proposer = getattr(self, "_proposer", None)
        return proposer.state() if proposer is not None else None

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Greedily (or, with ``self.sampling``, by speculative sampling) generate ``max_new_tokens`` tokens.

        Args:
            input_ids: prompt ids, shape (1, prompt_len), int64, on the target's device.
            max_new_tokens: T (>= 1).

        Yields:
            One Step per target forward (the chain loop's Steps).
        """
        p = self.params
        self._proposer = NgramProposer(p.min_n, p.max_n, p.occurrence)
        yield from speculate_chain(
            KVTarget(self.target),
            self._proposer,
            input_ids,
            max_new_tokens,
            p.k,
            self.sampling,
            self.generator,
            eos_token_id=self.eos_token_id,
        )

    @torch.inference_mode()
    def generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> Iterator[dict[int, Step]]:
        """B prompts through the one chain loop, one lookup proposer per row (each over its own row's text)."""
        p = self.params
        proposers = [NgramProposer(p.min_n, p.max_n, p.occurrence) for _ in prompts]
        self._proposer = proposers[-1]
        yield from decoder_rows(self, proposers, prompts, max_new_tokens, p.k)
