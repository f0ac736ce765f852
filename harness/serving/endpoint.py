"""A served engine as the server kit asks it (issue 66): :class:`Endpoint` sends the run's requests (the run's client,
:func:`dtbench.harness.serving.client.group_requests`; the engine adapter writes and reads each one), recovers the ids
llama.cpp holds back as a run does, asks top candidates at a divergence, writes a request as ``curl`` and reads the
engine's version and model; :class:`ServerDown` ends every later check with one line.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from dtbench.core import DtbenchError, clip, redact_credentials
from dtbench.decoders.engines import Engine, engine_for
from dtbench.harness.serving.check import candidate_shapes
from dtbench.harness.serving.params import ServerParams, auth_headers, tls_context


class ServerDown(DtbenchError):
    """The engine (or the reference) cannot be asked any more: unreachable, exited, or a request past its timeout.
    Every check from then on fails with this one line."""


@dataclass
class Answer:
    """One completion as the client read it: ``tokens`` (ids), ``text``, ``finish`` (finish_reason), ``counters``
    (the engine's per-response counters), ``error`` (one line; None: it succeeded)."""

    tokens: list[int]
    text: str = ""
    finish: str | None = None
    counters: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class Endpoint:
    """A served engine the kit asks: a label (what the table and errors call it), its :class:`ServerParams` (the
    engine adapter, the key's variable, ``tie_margin``), its base URL (as given: credentials are sent, never shown)
    and, when dtbench launched it, the :class:`~dtbench.harness.serving.process.Launched` process.

    Requests are the run's: :func:`dtbench.harness.serving.client.group_requests` streams them (the engine adapter
    writes and reads each one); a non-streamed one goes through ``httpx`` with the adapter's body, ``stream`` false.
    Answers to requests sent alone are cached by body (hypothesis replays an example while it shrinks)."""

    def __init__(self, label: str, params: ServerParams, base_url: str, server: Any = None, tokenizer: Any = None):
        from dtbench.harness.serving.record import token_bytes_of

        self.label, self.params, self.server = label, params, server
        self.base_url = base_url.rstrip("/")
        self.shown_url = redact_credentials(self.base_url)
        self.engine: Engine = engine_for(params.engine)
        self.where = f"see its log {server.log_path}" if server is not None else f"at {self.shown_url}"
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes_of(tokenizer) if tokenizer is not None else None
        self.down: str | None = None  # why it cannot be asked any more
        self.cache: dict[str, Answer] = {}
        self.answers: list[Answer] = []  # every answer read (the accounting check's material)
        self.sent = 0

    def body(self, prompt: list[int], T: int, stop_at_eos: bool, stop: list[str] | None = None) -> dict[str, Any]:
        """The adapter's streamed request body (greedy, ``max_tokens`` T), with ``stop`` strings when given."""
        body = self.engine.request_body(self.params, list(prompt), T, stop_at_eos)
        if stop:
            body["stop"] = list(stop)
        return body

    def _fail(self, what: str) -> ServerDown:
        code = self.server.exited() if self.server is not None else None
        if code is not None:
            what = f"exited with code {code}"
        self.down = f"server '{self.label}' {what}; {self.where}"
        return ServerDown(self.down)

    def send(self, bodies: list[dict[str, Any]], concurrency: int = 1) -> list[Answer]:
        """The bodies as streamed requests, ``concurrency`` in flight (one client: the run's own), in order.

        Raises:
            ServerDown: the server is unreachable or exited, or a request ran past the request timeout.
        """
        import asyncio

        from dtbench.harness.serving.client import group_requests
        from dtbench.harness.serving.traffic import schedule

        if self.down:
            raise ServerDown(self.down)
        self.sent += len(bodies)
        traffic = schedule(len(bodies), concurrency, None, 0)  # all ready at once, C in flight
        try:
            records, *_ = asyncio.run(
                group_requests(self.base_url, bodies, self.params, traffic, self.tokenize, self.engine)
            )
        except (DtbenchError, OSError, Exception) as exc:  # unreachable (ConnectError), an error event, ...
            raise self._fail(f"is unreachable: {clip(exc, 200)}") from None
        out = []
        for rec, body in zip(records, bodies):
            if rec.error is not None and ("no answer from" in rec.error or "Timeout" in rec.error):
                raise self._fail(f"did not answer in time: {rec.error}")
            if rec.error is None and rec.decoded and len(rec.tokens) < rec.decoded:
                self._recover(body, rec)  # ids llama.cpp held back inside a UTF-8 character: the run's recovery
            out.append(Answer(list(rec.tokens), rec.text, rec.finish, dict(rec.counters), rec.error))
        if self.server is not None and self.server.exited() is not None:
            raise self._fail("exited")
        self.answers.extend(a for a in out if a.error is None)
        return out

    def tokenize(self, text: str) -> list[int]:
        """Text as the tokenizer's ids ([] without a tokenizer): a text-only engine's output."""
        if self.tokenizer is None:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else str(self.tokenizer.decode(ids, clean_up_tokenization_spaces=False))

    def _recover(self, body: dict[str, Any], rec: Any) -> None:
        """A stream's held-back token ids, as a run recovers them (:func:`~dtbench.harness.serving.record.
        recover_ids`); when they cannot be told, the answer is a failed request saying so, never a divergence."""
        from dtbench.harness.serving.record import recover_ids

        try:
            recover_ids(self.base_url, body, rec, self.engine, self.label, self.where, self.detokenize,
                        self.token_bytes, auth_headers(self.params))  # fmt: skip
        except DtbenchError as exc:
            rec.error = f"its stream held back token ids that could not be recovered: {clip(exc, 200)}"

    def once(self, body: dict[str, Any]) -> Answer:
        """One streamed request sent alone (cached by its body)."""
        key = json.dumps(body, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = self.send([body])[0]
        return self.cache[key]

    def unstreamed(self, body: dict[str, Any]) -> Answer:
        """The same request, not streamed (``stream`` false, no ``stream_options``).

        Raises:
            ServerDown: as :meth:`send`.
        """
        import httpx

        if self.down:
            raise ServerDown(self.down)
        plain = {k: v for k, v in body.items() if k != "stream_options"}
        plain["stream"] = False
        self.sent += 1
        try:
            response = httpx.post(
                self.base_url + "/v1/completions",
                json=plain,
                timeout=self.params.request_timeout_s,
                headers=auth_headers(self.params),
                verify=tls_context(),
            )
        except httpx.TimeoutException:
            raise self._fail(
                f"did not answer in time: no answer from /v1/completions within {self.params.request_timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise self._fail(f"is unreachable: {clip(exc, 200)}") from None
        if response.status_code != 200:
            return Answer([], error=f"HTTP {response.status_code}: {clip(response.text, 200)}")
        try:
            chunk = self.engine.parse_event(response.json())
        except (ValueError, DtbenchError) as exc:
            return Answer([], error=f"HTTP 200 but the body is no completion: {clip(exc, 200)}")
        tokens = list(chunk.tokens) if chunk.tokens is not None else self.tokenize(chunk.text)
        return Answer(tokens, chunk.text, chunk.finish, dict(chunk.counters))

    def candidates(self, prompt: list[int], reference: list[int], i: int) -> Any:
        """This engine's top candidates at output position i of ``reference`` in its decode and prefill shapes
        (:func:`~dtbench.harness.serving.check.candidate_shapes`).

        Raises:
            ServerDown: the check requests failed.
        """
        if self.down:
            raise ServerDown(self.down)
        try:
            return candidate_shapes(
                self.base_url, self.params, list(prompt), list(reference), i, max(self.params.top_logprobs, 5)
            )
        except (DtbenchError, OSError, Exception) as exc:
            raise self._fail(f"failed a check request (top candidates): {clip(exc, 200)}") from None

    def curl(self, body: dict[str, Any]) -> str:
        """The request as a ``curl`` command a user can paste: the URL with credentials masked, the key as its
        environment variable (``$NAME``), never its value."""
        parts = ["curl", "-sS", f"{self.shown_url}/v1/completions", "-H", "Content-Type: application/json"]
        cmd = " ".join(shlex.quote(p) for p in parts)
        if self.params.api_key_env:
            cmd += f' -H "Authorization: Bearer ${self.params.api_key_env}"'
        return cmd + " -d " + shlex.quote(json.dumps(body, separators=(",", ":")))

    def identity(self) -> dict[str, Any]:
        """The engine's version and model as the server reports them (each asked with a 5 s limit, best effort):
        ``/version`` (vLLM, SGLang's ``version``), ``/props`` (llama.cpp: ``build_info``, ``model_path``, the slot's
        ``n_ctx``) and ``/v1/models`` (the served model's id, vLLM's ``max_model_len``)."""
        import httpx

        out: dict[str, Any] = {"label": self.label, "engine": self.params.engine, "url": self.shown_url}
        if self.down:
            return out
        headers = auth_headers(self.params)

        def get(path: str) -> Any:
            try:
                answer = httpx.get(self.base_url + path, timeout=5.0, headers=headers, verify=tls_context())
                return answer.json() if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        version = get("/version")
        if isinstance(version, dict) and version.get("version"):
            out["version"] = str(version["version"])
        props = get("/props")
        if isinstance(props, dict):
            if props.get("build_info"):
                out.setdefault("version", str(props["build_info"]))
            if props.get("model_path"):
                out["model"] = str(props["model_path"])
            settings = props.get("default_generation_settings")
            if isinstance(settings, dict) and isinstance(settings.get("n_ctx"), int):
                out["n_ctx"] = settings["n_ctx"]
        models = get("/v1/models")
        if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
            first = models["data"][0] if isinstance(models["data"][0], dict) else {}
            out.setdefault("model", str(first.get("id", "")) or None)
            if isinstance(first.get("max_model_len"), int):
                out.setdefault("n_ctx", first["max_model_len"])
        return out
