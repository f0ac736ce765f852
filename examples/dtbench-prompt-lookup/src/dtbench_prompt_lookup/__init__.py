"""Prompt lookup decoding as a dtbench decoder plugin (an example of a third-party decoder package).

Prompt lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding) drafts without a
draft model: the last ``n`` tokens of the sequence are looked up earlier in the sequence (prompt and generated
text), and the tokens that followed the most recent earlier occurrence are proposed as the draft. The target
verifies them in one forward with greedy acceptance, as in linear speculative decoding (Leviathan et al. 2023),
so the output equals greedy autoregressive decoding token for token.

Only dtbench's public plugin API is imported, :mod:`dtbench.api`: the decoder contract and the one chain loop
(a :class:`~dtbench.api.Proposer` is all a chain method writes).
Registered by this distribution's entry point ``prompt_lookup = "dtbench_prompt_lookup:PromptLookup"`` in the
``dtbench.decoders`` group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from pydantic import Field

from dtbench.api import (
    Dataset,
    DatasetParams,
    Decoder,
    DecoderParams,
    Document,
    DtbenchError,
    KVTarget,
    Proposer,
    Step,
    speculate_chain,
)

__all__ = [
    "JsonlText",
    "JsonlTextParams",
    "NgramIndex",
    "NgramProposer",
    "PromptLookup",
    "PromptLookupParams",
    "render_tsv",
]
__version__ = "0.1.0"


class PromptLookupParams(DecoderParams):
    """Hyperparameters of prompt lookup decoding.

    Attributes:
        ngram_size: longest n-gram matched (transformers' ``max_matching_ngram_size``); when the last
            ``ngram_size`` tokens occur nowhere earlier, shorter suffixes are tried, down to one token.
        num_draft_tokens: tokens copied after the match and verified per iteration (transformers'
            ``prompt_lookup_num_tokens``).
    """

    ngram_size: int = Field(3, ge=1, le=16, description="longest n-gram matched (tries shorter ones down to 1)")
    num_draft_tokens: int = Field(10, ge=1, le=128, description="draft tokens copied per iteration")


class NgramIndex:
    """The most recent earlier occurrence of every n-gram (n = 1 .. max_n) of a growing token sequence.

    ``tokens`` is the sequence (a list of ints, appended to by :meth:`extend`). For each n-gram ending at
    position ``j`` with a continuation (``j < len(tokens) - 1``), the index maps it to ``j + 1``; later
    occurrences overwrite earlier ones. Updating costs O(max_n) dictionary operations per token.
    """

    def __init__(self, max_n: int, tokens: list[int]):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def extend(self, new: list[int] | tuple[int, ...]) -> None:
        """Append tokens and index every n-gram that now has a continuation."""
        tokens = self.tokens
        first = max(len(tokens) - 1, 0)  # position j whose continuation is the first new token
        tokens.extend(new)
        for j in range(first, len(tokens) - 1):
            for n in range(1, min(self.max_n, j + 1) + 1):
                self._maps[n][tuple(tokens[j - n + 1 : j + 1])] = j + 1

    def lookup(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the most recent earlier occurrence of the longest matching suffix.

        Returns:
            The draft (possibly shorter than ``count``, empty when no suffix of length 1 .. max_n recurs).
        """
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            start = self._maps[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + count]
        return []


class NgramProposer(Proposer):
    """Drafts copied from the context by :class:`NgramIndex` (the committed text, prompt included)."""

    def __init__(self, ngram_size: int):
        self.ngram_size = ngram_size

    def begin(self, prompt: list[int], pending: int) -> None:
        self.index = NgramIndex(self.ngram_size, [*prompt, pending])

    def propose(self, max_tokens: int) -> list[int]:
        return self.index.lookup(max_tokens) if max_tokens > 0 else []

    def accept(self, drafts: list[int], accepted: int, committed: tuple[int, ...]) -> None:
        self.index.extend(committed)


class PromptLookup(Decoder):
    """Prompt lookup decoding: n-gram-matched drafts from the context, verified greedily by the target.

    The first Step is the prefill. Each later Step is one target forward over ``[pending, *draft]``; a Step
    whose lookup found nothing verifies no draft and commits one token (``drafted = 0``). Lossless: the output
    equals ``ar``'s.
    """

    Params = PromptLookupParams
    needs_draft = False
    lossless = True
    supports_sampling = True  # deterministic drafts, verified by speculative sampling when the suite samples
    version = "1"
    family = "chain"  # dtbench's chain loop: calibrated, priced and given a best K like the built-in chains
    compiles = True  # every forward goes through speculate_chain + KVTarget: it runs under `execution: compiled`

    @classmethod
    def check_settings(cls, ctx) -> list[dict]:
        """What ``dtbench check`` / ``dtbench.testing`` checks: the defaults (10 drafts) and a short, one-token match."""
        return [{}, {"ngram_size": 1, "num_draft_tokens": 4}]

    @classmethod
    def verify_sizes(cls, params: PromptLookupParams) -> tuple[int, int]:
        """(num_draft_tokens + 1, 0): the pending token and the looked-up drafts in one causal forward."""
        return params.num_draft_tokens + 1, 0

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Generate ``max_new_tokens`` tokens (fewer when the runner set ``eos_token_id`` and EOS comes first).

        Args:
            input_ids: prompt ids, shape (1, prompt_len), int64, on the target's device.
            max_new_tokens: T (>= 1).

        Yields:
            One Step per target forward (dtbench's chain loop: drafts never pass T).
        """
        p = self.params
        yield from speculate_chain(
            KVTarget(self.target),
            NgramProposer(p.ngram_size),
            input_ids,
            max_new_tokens,
            p.num_draft_tokens,
            self.sampling,
            self.generator,
            self.eos_token_id,
        )


class JsonlTextParams(DatasetParams):
    """The ``jsonl-text`` dataset's own suite keys (an entry's ``params:``), validated before any model loads.

    Attributes:
        text_field: the JSON field of each line that holds the document's text.
    """

    text_field: str = Field("text", min_length=1, max_length=200, description="JSON field holding the text")


class JsonlText(Dataset):
    """A dataset plugin: one document per line of a JSON Lines file (``path:``), its ``text_field`` field
    (``params: {text_field: ...}``, default ``"text"``).

    Prompt lookup pays off on inputs that repeat themselves (retrieval-augmented answers, code edits); such
    corpora usually come as JSONL. Registered as ``jsonl-text`` in the ``dtbench.datasets`` group.
    """

    Params = JsonlTextParams

    def documents(self, spec, data_dir):
        import json
        from pathlib import Path

        if not spec.path:
            raise DtbenchError("jsonl-text: set `path:` to a .jsonl file")
        path = Path(spec.path).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DtbenchError(f"jsonl-text: cannot read {path}: {exc}") from None
        field = self.params.text_field
        docs = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                docs.append((f"{path.name}:{i}", str(json.loads(line)[field])))
            except (ValueError, KeyError, TypeError):
                raise DtbenchError(
                    f"jsonl-text: {path}:{i}: not a JSON object with a {json.dumps(field)} field"
                ) from None
        return docs

    def check(self, spec):
        self.documents(spec, None)


def render_tsv(doc: Document) -> str:
    """A report format: every report's rows as tab-separated values (``dtbench report --format tsv``).

    Registered by this distribution's entry point ``tsv = "dtbench_prompt_lookup:render_tsv"`` in the
    ``dtbench.formats`` group; it receives the same :class:`~dtbench.api.Document` the built-in renderers do.
    """
    return doc.frame().to_csv(sep="\t", index=False)
