"""The engine adapter contract (issue 40 item 3): how a request is written to one kind of OpenAI-compatible server and
how its answers and counters are read.

:class:`Engine` is the protocol the harness (:mod:`dtbench.harness.serving`) calls; :class:`OpenAICompatible` implements
it for the plain OpenAI completions format (``/v1/completions``: ``choices[0].text``, ``finish_reason``, ``logprobs``,
``usage``) and is the base every built-in adapter extends with its engine's own fields (:meth:`OpenAICompatible.read`,
:meth:`OpenAICompatible.stream_fields`, :meth:`OpenAICompatible.top_fields`, :meth:`OpenAICompatible.acceptance`, the
metrics endpoint). Adapters are registered by name (:mod:`dtbench.decoders.engines`), never branched on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from dtbench.core import DtbenchError

Candidates = list[list[tuple[Any, float]]]  # per token, [(token id or text, log-probability), ...] best first
Span = tuple[int, int, int]  # (first batch size, last batch size, chain length K) of a speculation schedule


class ServerParams(Protocol):
    """What an adapter reads of a server's params (:class:`dtbench.decoders.server.ServerParams` has more)."""

    @property
    def model(self) -> str | None:
        """The request's ``model`` field (None: not sent)."""
        ...

    @property
    def extra_body(self) -> dict[str, Any]:
        """More request fields, sent as given."""
        ...


@dataclass
class Chunk:
    """What one streamed response event (or one non-streamed answer) carried.

    Attributes:
        tokens: the token ids it committed (None: the engine sent text only).
        text: its text.
        top: per token, the top candidates ``[(token id or text, log-probability), ...]`` best first ([] if none).
        counters: per-response speculation counters found in it (the final event's, usually), by
            ``"<engine>:<name>"``.
        finish: the finish reason, where it carried one.
        decoded: tokens the server had decoded when it sent the event (llama.cpp ``tokens_predicted``), None if not
            sent.
    """

    tokens: list[int] | None
    text: str = ""
    top: Candidates = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    decoded: int | None = None


@runtime_checkable
class Engine(Protocol):
    """One kind of server, as the harness speaks to it. Methods never do I/O: the harness sends and times.

    Attributes:
        metrics_path: the path of counters read before and after each unit of requests (vLLM's ``/metrics``), None
            when the engine reports its speculation per response.
        schedules: whether :meth:`schedule` states a speculation schedule (``dtbench report --schedule``).
    """

    metrics_path: ClassVar[str | None]
    schedules: ClassVar[bool]

    def request_body(
        self, params: ServerParams, prompt: list[int] | str, max_tokens: int, stop_at_eos: bool
    ) -> dict[str, Any]:
        """The JSON body of one streamed, greedy ``/v1/completions`` request of ``max_tokens`` (T) new tokens."""
        ...

    def top_body(self, params: ServerParams, prompt: list[int], n: int, tokens: int = 1) -> dict[str, Any]:
        """The body of one non-streamed check request: the top ``n`` candidates of the next ``tokens`` tokens."""
        ...

    def parse_event(self, event: dict[str, Any]) -> Chunk:
        """One server-sent event's JSON (or a non-streamed answer) as a :class:`Chunk`; raises DtbenchError for an
        error object."""
        ...

    def acceptance(self, counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
        """One response's speculation from its counters (``{}``: it reported none); raises DtbenchError for
        counters that are no counts or contradict each other."""
        ...

    def parse_metrics(self, text: str) -> dict[str, Any]:
        """The counters of a :attr:`metrics_path` answer."""
        ...

    def metrics_delta(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        """``after - before`` of two :meth:`parse_metrics` snapshots; raises DtbenchError for impossible numbers."""
        ...

    def schedule(self, spans: list[Span]) -> dict[str, Any] | None:
        """A speculation schedule (per batch-size range the chain length K) in the engine's configuration terms."""
        ...


def count(counters: dict[str, Any], key: str, default: int | None = None) -> int:
    """A server-reported counter as a count: a finite, non-negative whole number (a server is not trusted: issue 42
    item 4; NaN, infinity, negatives and fractions are refused).

    Raises:
        DtbenchError: the value is missing (no ``default``) or not such a count (the caller names the server and its
            log).
    """
    value = counters.get(key, default)
    if value is None:
        raise DtbenchError(f"its speculation counter {key.split(':', 1)[-1]} is missing")
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 and float(value).is_integer()):
        raise DtbenchError(f"its speculation counter {key.split(':', 1)[-1]} is {value!r}, not a count of tokens")
    return int(value)


def candidate_id(key: Any) -> Any:
    """A candidate's token id from a ``token_id:N`` key (vLLM's ``return_tokens_as_token_ids``); other keys (text)
    are returned as they are."""
    if isinstance(key, str) and key.startswith("token_id:"):
        try:
            return int(key.split(":", 1)[1])
        except ValueError:
            return key
    return key


class OpenAICompatible:
    """``openai``-format completions (any OpenAI-compatible server): a text or token-id prompt, a text stream, no
    speculation counters. The base of every built-in adapter, which adds its engine's fields through the hooks.
    Stateless: one instance serves every cell."""

    metrics_path: ClassVar[str | None] = None
    schedules: ClassVar[bool] = False

    def placeholders(self) -> dict[str, Callable[[], str]]:
        """The engine's own placeholders of a ``launch:`` command (e.g. ``{llama_server}``), each with the function
        that resolves it when a server is launched (raising DtbenchError, one line, when it cannot); none here.
        Optional for an adapter that does not extend this class (the harness reads it with ``getattr``)."""
        return {}

    def ready(self, status: int, body: str) -> bool:
        """Whether the answer of the server's health endpoint (``health_path``: its HTTP ``status`` and ``body``) says
        it is ready to serve: an HTTP 200 here (llama.cpp answers 503 while it loads its model; vLLM and SGLang 200
        once they serve). The launch's readiness wait asks the adapter (issue 59 item 7), so an engine whose health
        answer says more (a 200 that still loads) overrides this. Optional for an adapter that does not extend this
        class (the harness reads it with ``getattr``, and takes a 200 as ready without it)."""
        return status == 200

    def stream_fields(self, stop_at_eos: bool) -> dict[str, Any]:
        """The engine's own fields of a timed request (token ids, EOS handling); none in the OpenAI format."""
        return {}

    def top_fields(self, n: int) -> dict[str, Any]:
        """The fields that ask for the top ``n`` log-probabilities per token (OpenAI's ``logprobs``)."""
        return {"logprobs": n}

    def request_body(
        self, params: ServerParams, prompt: list[int] | str, max_tokens: int, stop_at_eos: bool
    ) -> dict[str, Any]:
        """The JSON body of one streamed, greedy ``/v1/completions`` request.

        Args:
            params: the server's params (``model`` and ``extra_body`` are sent as given, ``extra_body`` last).
            prompt: token ids (``prompt_format: tokens``) or text.
            max_tokens: T, the new tokens asked for.
            stop_at_eos: False: the engine is told to ignore EOS where it can, so exactly T tokens come back (the
                paper's protocol).
        """
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.model:
            body["model"] = params.model
        body.update(self.stream_fields(stop_at_eos))
        body.update(params.extra_body)
        return body

    def top_body(self, params: ServerParams, prompt: list[int], n: int, tokens: int = 1) -> dict[str, Any]:
        """The body of one non-streamed check request (outside the timed region): the top ``n`` candidates of the
        next ``tokens`` tokens after ``prompt`` (the request's prompt plus the reference's output up to a
        divergence), greedy.

        Asked apart because top log-probabilities are not free: llama.cpp's ``n_probs`` sorts the vocabulary at
        every token (measured here: 53 -> 248 ms per token for SmolLM2-135M on 2 CPU cores), which the timed requests
        must not pay."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": False}
        if params.model:
            body["model"] = params.model
        body.update(self.top_fields(n))
        return body

    def read(self, event: dict[str, Any], choice: dict[str, Any], chunk: Chunk) -> None:
        """Read the engine's own fields of one event into ``chunk`` (after the OpenAI fields, before ``usage``);
        nothing in the OpenAI format."""

    def parse_event(self, event: dict[str, Any]) -> Chunk:
        """One server-sent event's JSON (``data: {...}``), or a non-streamed answer, as a :class:`Chunk`.

        The OpenAI fields: ``choices[0].text`` and ``finish_reason``; ``logprobs`` as a list of ``content`` entries
        (the chat shape: ``id`` where the server sends one, llama.cpp's ``to_json_oaicompat``, and
        ``top_logprobs[j]``) or as ``tokens`` / ``top_logprobs`` dicts (the completions shape: keys are text, or
        ``token_id:N``); ``usage.completion_tokens``. Then the engine's own fields (:meth:`read`).

        Raises:
            DtbenchError: the event is an error object (``{"error": ...}``).
        """
        if "error" in event:
            err = event["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise DtbenchError(f"the server answered with an error: {str(message)[:300]}")
        choices = event.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        chunk = Chunk(tokens=None, text=choice.get("text") or "", finish=choice.get("finish_reason"))
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            content = logprobs["content"]
            chunk.tokens = [int(c["id"]) for c in content if "id" in c]
            chunk.top = [
                [
                    (int(t["id"]) if "id" in t else t.get("token"), float(t.get("logprob", math.nan)))
                    for t in c.get("top_logprobs", [])
                ]
                for c in content
            ]
        elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
            ids = [candidate_id(t) for t in logprobs["tokens"]]
            if all(isinstance(i, int) for i in ids):
                chunk.tokens = ids
            for cands in logprobs.get("top_logprobs") or []:
                pairs = sorted(((candidate_id(k), float(v)) for k, v in (cands or {}).items()), key=lambda p: -p[1])
                chunk.top.append(pairs)
        self.read(event, choice, chunk)
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            chunk.counters["usage:completion_tokens"] = float(usage["completion_tokens"])
        return chunk

    def acceptance(self, counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
        """One response's server-reported speculation: drafted and accepted tokens, verification steps and the
        request's acceptance length (tokens per target verification step, the bonus token included).

        Returns:
            ``{"source", "drafted", "accepted", "steps", "acceptance_length", "steps_rule"}`` (values None where the
            source does not say), or {} when the response carried no speculation counters (here: always).
        """
        return {}

    def parse_metrics(self, text: str) -> dict[str, Any]:
        """The counters of a :attr:`metrics_path` answer ({}: no metrics endpoint)."""
        return {}

    def metrics_delta(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        """``after - before`` of two :meth:`parse_metrics` snapshots ({}: no metrics endpoint)."""
        return {}

    def schedule(self, spans: list[Span]) -> dict[str, Any] | None:
        """The speculation schedule in this engine's configuration terms; None: the engine takes none
        (:attr:`schedules` False).

        Args:
            spans: ``(first B, last B, K)`` per range of batch sizes that share the predicted best chain length K (0:
                speculation predicted not to pay), in increasing B.
        """
        return None
