"""The prompts the server kit searches (issue 66): hypothesis strategies of token-id lists over the target's tokenizer
and the dataset's text, and a prompt's SHA-256 as a bug report names it."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def prompt_sha256(prompt: list[int] | str) -> str:
    """The SHA-256 (hex) of a prompt as sent: the UTF-8 of its text, or of its token ids as compact JSON
    (``[1,2,3]``)."""
    data = prompt if isinstance(prompt, str) else json.dumps(list(prompt), separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


class PromptSpace:
    """The prompts the kit searches (hypothesis strategies of token-id lists), from the target's tokenizer and the
    dataset's documents: *text* (a slice of a document), *random* (ids of ordinary tokens), *ngram* (an n-gram of 1-4
    tokens repeated 2-48 times), *word* (a word of the text repeated 2-48 times, as ``"serving" * 48``) and, when the
    context length is known, *near context* (a prompt leaving 0-7 tokens of the context after T). Hypothesis shrinks
    each kind toward shorter prompts (fewer repeats, a shorter slice, fewer ids)."""

    def __init__(self, tokenizer: Any, documents: list[str], n_ctx: int | None, max_T: int):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", None) or [])
        self.docs = [self.encode(d)[:4096] for d in documents[:32]]
        self.docs = [d for d in self.docs if len(d) >= 8]
        words: list[str] = []
        for d in documents[:32]:
            words.extend(w for w in d.split() if w.isalpha() and len(w) >= 4)
        self.words = sorted(set(words))[:400] or ["serving"]
        self.n_ctx, self.max_T = n_ctx, max_T

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text_of(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), clean_up_tokenization_spaces=False))

    def ordinary(self) -> Any:
        from hypothesis import strategies as st

        return st.integers(0, self.vocab - 1).filter(lambda t: t not in self.special)

    def kinds(self, near_context: bool = False) -> dict[str, Any]:
        """The strategies by kind (each draws a list of token ids)."""
        from hypothesis import strategies as st

        out: dict[str, Any] = {}
        if self.docs:
            docs = self.docs
            out["text"] = st.tuples(st.integers(0, len(docs) - 1), st.integers(0, 4096), st.integers(1, 64)).map(
                lambda a: docs[a[0]][a[1] % len(docs[a[0]]) :][: a[2]] or docs[a[0]][: a[2]]
            )
        out["ngram"] = st.tuples(st.lists(self.ordinary(), min_size=1, max_size=4), st.integers(2, 48)).map(
            lambda a: a[0] * a[1]
        )
        words = self.words
        out["word"] = st.tuples(st.sampled_from(words), st.integers(2, 48), st.sampled_from(["", " "])).map(
            lambda a: self.encode(a[2].join([a[0]] * a[1])) or [0]
        )
        out["random"] = st.lists(self.ordinary(), min_size=1, max_size=48)
        if near_context and self.n_ctx and self.docs and self.n_ctx - self.max_T - 8 >= 16:
            flat = [t for d in self.docs for t in d]
            length = self.n_ctx - self.max_T - 8

            def near(extra: int) -> list[int]:
                return (flat * (length // len(flat) + 1))[: length + extra]

            out["near context"] = st.integers(0, 7).map(near)
        return out

    def prompts(self, near_context: bool = False) -> Any:
        """One strategy over every kind (hypothesis shrinks toward the first kinds: text, then the repeats)."""
        from hypothesis import strategies as st

        kinds = self.kinds(near_context)
        near = kinds.pop("near context", None)
        common = st.one_of(*kinds.values())
        if near is None:
            return common
        # one example in ten near the context length (a long prefill on both engines: seconds on a CPU server);
        # the shrinker moves toward 0, away from it, unless only such a prompt fails
        return st.integers(0, 9).flatmap(lambda k: near if k == 9 else common)
