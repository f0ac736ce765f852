"""What the client saw of one server request (:class:`RequestRecord`) and the recovery of token ids a stream held
back (:func:`recover_ids`): the record the client (:mod:`~dtbench.harness.serving.client`) fills and checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtbench.decoders.engines import Engine
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
    recovered: str | None = None  # how the held-back ids were found: "repeat" or "prefix" (see recover_ids)
    resent: int = 0  # sends the server closed before any response (see client._one): the request was sent again


def recover_ids(
    base_url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    engine: Engine,
    label: str,
    where: str,
    detokenize: Callable[[list[int]], str],
) -> None:
    """The token ids of a stream that held tokens back (llama.cpp: a UTF-8 character split over several byte tokens,
    the event that completes it carries one id, ``rec.gaps`` the positions left out), from requests that are not
    streamed and not timed, whose answers list every id (read by the engine adapter):

    1. *repeat*: the same request once more; taken if it has as many tokens, the ids the stream sent at the same
       positions and a text that begins with the streamed text (a character cut at the end is never streamed);
    2. *prefix* (when the repeat took another path: at concurrency > 1 the stream ran batched beside other requests,
       the repeat alone, and batch shapes round differently): each gap filled by a greedy request continuing from
       the prompt and the output before it, the filled output taken if its text (``detokenize``, the target's
       tokenizer) begins with the streamed text.

    Raises:
        ServerError: neither reproduced the streamed output (the ids cannot be told).
    """
    import httpx

    def ask(extra: dict[str, Any]) -> list[int] | None:
        response = httpx.post(base_url + "/v1/completions", json={**body, **extra, "stream": False}, timeout=600)
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
    if rec.gaps and isinstance(prompt, list) and len(held) + len(rec.tokens) == rec.decoded:
        filled = list(streamed)
        for a, b in rec.gaps:
            part = ask({"prompt": [*prompt, *filled[:a]], "max_tokens": b - a})
            if part is None or len(part) != b - a:
                break
            filled[a:b] = part
        else:
            if agrees(full := [int(t) for t in filled if t is not None]) and len(full) == rec.decoded:
                rec.tokens, rec.recovered = full, "prefix"
                return
    raise ServerError(
        f"server '{label}' streamed {len(rec.tokens)} token ids for {rec.decoded} tokens and neither a repeat nor "
        f"requests continuing the streamed output reproduced its text; {where}"
    )
