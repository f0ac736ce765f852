"""What the client saw of one server request (:class:`RequestRecord`) and the recovery of token ids a stream held
back (:func:`recover_ids`, with the tokenizer's bytes per token, :class:`TokenBytes`): the record the client
(:mod:`~dtbench.harness.serving.client`) fills and checks."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtbench.decoders.engines import Engine
from dtbench.decoders.engines.params import tls_context
from dtbench.harness.serving.process import ServerError


@dataclass
class RequestRecord:
    """What the client saw of one request: send offset, reads with the tokens each brought, counters, top-2."""

    row: int
    sent_s: float = 0.0  # seconds from the group's start to the send
    reads: list[tuple[float, int]] = field(default_factory=list)  # (seconds from the send, tokens it brought)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    top: list[list[tuple[Any, float]]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    done_s: float = 0.0  # seconds from the group's start to the last read
    decoded: int = 0  # the server's own count of decoded tokens at its last event (llama.cpp), 0 if not sent
    gaps: list[tuple[int, int]] = field(default_factory=list)  # output positions [start, end) streamed without ids
    # per gap, the (text, ids) of the event that ended it (its text holds the gap's bytes), None: the final event's
    gap_events: list[tuple[str, list[int]] | None] = field(default_factory=list)
    recovered: str | None = None  # how the held-back ids were found: "repeat" or "prefix" (see recover_ids)
    resent: int = 0  # sends the server closed before any response (see client._one): the request was sent again
    # why the request failed, one line (an HTTP error status, an error event, a timeout, a dropped connection); None:
    # it succeeded. A failed request is data, not the unit's end (issue 59 item 7: serving/failures.py)
    error: str | None = None


class TokenBytes:
    """The bytes each token id of a tokenizer stands for, and the ways to write given bytes as n tokens.

    Byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen: a ``ByteLevel`` decoder) maps every byte to one printable character
    (GPT-2's ``bytes_to_unicode``); SentencePiece vocabularies write a byte as ``<0xNN>`` and a space as ``▁``. Other
    tokens are left out, so a split is only a candidate: :func:`recover_ids` checks it by decoding.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    @functools.cached_property
    def _tables(self) -> tuple[dict[int, bytes], dict[bytes, list[int]]]:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab: dict[str, int] = self._tokenizer.get_vocab()
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        decoder = {c: b for b, c in bytes_to_unicode().items()}
        of: dict[int, bytes] = {}
        for piece, i in vocab.items():
            if byte_level:
                if all(c in decoder for c in piece):
                    of[i] = bytes(decoder[c] for c in piece)
            elif m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
                of[i] = bytes([int(m.group(1), 16)])
            else:
                of[i] = piece.replace("\u2581", " ").encode()
        ids: dict[bytes, list[int]] = {}
        for i, data in sorted(of.items()):
            ids.setdefault(data, []).append(i)
        return of, ids

    def of(self, ids: list[int]) -> bytes | None:
        """The bytes of ``ids`` joined; None if one of them is not in the table (a special or unknown token)."""
        of = self._tables[0]
        return b"".join(of[i] for i in ids) if all(i in of for i in ids) else None

    def splits(self, data: bytes, n: int, limit: int = 8) -> list[list[int]]:
        """Up to ``limit`` lists of ``n`` token ids whose bytes joined are ``data`` (8 bytes or so: one gap)."""
        ids = self._tables[1]
        found: list[list[int]] = []

        def walk(at: int, left: int, path: list[int]) -> None:
            if len(found) >= limit:
                return
            if left == 0:
                if at == len(data):
                    found.append(path)
                return
            for end in range(at + 1, len(data) - left + 2):
                for i in ids.get(data[at:end], []):
                    walk(end, left - 1, [*path, i])

        walk(0, n, [])
        return found


@functools.lru_cache(maxsize=4)
def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """One :class:`TokenBytes` per tokenizer (its table is built at the first gap that needs it, once)."""
    return TokenBytes(tokenizer)


def _from_text(
    event: tuple[str, list[int]] | None, n: int, token_bytes: TokenBytes | None, detokenize: Callable[[list[int]], str]
) -> list[int] | None:
    """The ``n`` held-back ids before ``event`` (text, ids), when the event's text less its ids' bytes splits into
    ``n`` tokens in exactly one way that decodes back to the event's text; otherwise None."""
    if event is None or token_bytes is None:
        return None
    text, tail_ids = event
    data, tail = text.encode(), token_bytes.of(tail_ids)
    if tail is None or not data.endswith(tail) or len(data) == len(tail):
        return None
    found = [c for c in token_bytes.splits(data[: len(data) - len(tail)], n) if detokenize([*c, *tail_ids]) == text]
    return found[0] if len(found) == 1 else None


def recover_ids(
    base_url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    engine: Engine,
    label: str,
    where: str,
    detokenize: Callable[[list[int]], str],
    token_bytes: TokenBytes | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """The token ids of a stream that held tokens back (llama.cpp: a UTF-8 character split over several byte tokens,
    the event that completes it carries one id, ``rec.gaps`` the positions left out), from the streamed text and from
    requests that are not streamed and not timed, whose answers list every id (read by the engine adapter):

    1. *repeat*: the same request once more; taken if it has as many tokens, the ids the stream sent at the same
       positions and a text that begins with the streamed text (a character cut at the end is never streamed);
    2. *text* / *prefix* (when the repeat took another path: at concurrency > 1 the stream ran batched beside other
       requests, the repeat alone, and batch shapes round differently, a near tie can go the other way): each gap
       filled from the text of the event that ended it (``rec.gap_events``: its bytes less its own ids' bytes, taken
       when ``token_bytes`` writes them as the gap's count of tokens in exactly one way: the ids the server sampled),
       else by a greedy request continuing from the prompt and the output before it; the filled output taken if its
       text (``detokenize``, the target's tokenizer) begins with the streamed text. ``recovered`` is "text" when
       every gap came from the text, else "prefix".

    Raises:
        ServerError: neither reproduced the streamed output (the ids cannot be told).
    """
    import httpx

    def ask(extra: dict[str, Any]) -> list[int] | None:
        response = httpx.post(
            base_url + "/v1/completions",
            json={**body, **extra, "stream": False},
            timeout=600,
            headers=headers,
            verify=tls_context(),
        )
        try:
            data = response.json() if response.status_code == 200 else {}
        except ValueError:  # not JSON: the ids cannot be told (below)
            data = {}
        answer = engine.parse_event(data) if isinstance(data, dict) and data and "error" not in data else None
        return list(answer.tokens) if answer is not None and answer.tokens else None

    held = {i for a, b in rec.gaps for i in range(a, b)}
    known = iter(rec.tokens)
    streamed: list[int | None] = [None if i in held else next(known, None) for i in range(rec.decoded)]

    def agrees(ids: list[int] | None) -> bool:
        return (
            ids is not None
            and len(ids) == rec.decoded
            and all(s is None or s == t for s, t in zip(streamed, ids))
            and detokenize(ids).startswith(rec.text)
        )

    ids = ask({})
    if agrees(ids):
        rec.tokens, rec.recovered = list(ids or []), "repeat"
        return
    prompt = body.get("prompt")
    if rec.gaps and len(held) + len(rec.tokens) == rec.decoded:
        filled, asked = list(streamed), 0
        events = [*rec.gap_events, *[None] * (len(rec.gaps) - len(rec.gap_events))]
        for (a, b), event in zip(rec.gaps, events):
            part = _from_text(event, b - a, token_bytes, detokenize)
            if part is None and isinstance(prompt, list):
                part, asked = ask({"prompt": [*prompt, *filled[:a]], "max_tokens": b - a}), asked + 1
            if part is None or len(part) != b - a:
                break
            filled[a:b] = part
        else:
            if agrees(full := [int(t) for t in filled if t is not None]) and len(full) == rec.decoded:
                rec.tokens, rec.recovered = full, "prefix" if asked else "text"
                return
    raise ServerError(
        f"server '{label}' streamed {len(rec.tokens)} token ids for {rec.decoded} tokens and neither a repeat nor "
        f"requests continuing the streamed output reproduced its text; {where}"
    )
